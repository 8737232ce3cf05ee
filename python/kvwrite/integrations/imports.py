"""Run code when a module is imported: how the engine hooks reach processes they do not start."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Callable


def when_imported(name: str, then: Callable[[ModuleType], None]) -> None:
    """Call `then(module)` once module `name` has executed: now if it is imported already, else
    right after its import (a one-shot meta-path finder wrapping the module's own loader)."""
    if name in sys.modules:
        then(sys.modules[name])
        return

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            inner = spec.loader

            class Loader(importlib.abc.Loader):
                def create_module(self, spec):
                    return inner.create_module(spec)

                def exec_module(self, module):
                    inner.exec_module(module)
                    then(module)
            spec.loader = Loader()
            return spec
    sys.meta_path.insert(0, Finder())
