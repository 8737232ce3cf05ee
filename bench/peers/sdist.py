"""Download one released sdist (name==version) from the package index with pip's own finder and
session, without building its metadata (pip download would build vLLM's to resolve it)."""
from __future__ import annotations

import sys
from pathlib import Path

from pip._internal.index.collector import LinkCollector
from pip._internal.index.package_finder import PackageFinder
from pip._internal.models.search_scope import SearchScope
from pip._internal.models.selection_prefs import SelectionPreferences
from pip._internal.network.session import PipSession


def main(spec: str, dest: str) -> int:
    name, version = spec.split("==")
    session = PipSession()
    scope = SearchScope.create(find_links=[], index_urls=["https://pypi.org/simple"], no_index=False)
    finder = PackageFinder.create(link_collector=LinkCollector(session=session, search_scope=scope),
                                  selection_prefs=SelectionPreferences(allow_yanked=False))
    for cand in finder.find_all_candidates(name):
        if str(cand.version) == version and cand.link.filename.endswith(".tar.gz"):
            out = Path(dest) / cand.link.filename
            resp = session.get(cand.link.url.split("#")[0])
            resp.raise_for_status()
            out.write_bytes(resp.content)
            print(out)
            return 0
    print(f"no sdist for {spec}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
