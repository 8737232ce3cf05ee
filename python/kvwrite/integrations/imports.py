"""Run code when a module is imported: how the engine hooks reach modules and processes they do not start."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Callable


class ImportHook(importlib.abc.MetaPathFinder):
    """A meta-path finder calling `then(module)` right after each module `match(name)` accepts has
    executed (wrapping the module's own loader); `once`: for the first such import only."""

    def __init__(self, match: Callable[[str], bool], then: Callable[[ModuleType], None], once: bool = False) -> None:
        self.match, self.then, self.once, self.busy = match, then, once, set()

    def find_spec(self, fullname, path, target=None):
        if fullname in self.busy or not self.match(fullname):
            return None
        if self.once:
            sys.meta_path.remove(self)
        self.busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        except (ImportError, ValueError):
            spec = None
        finally:
            self.busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        inner, then = spec.loader, self.then

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return inner.create_module(spec)

            def exec_module(self, module):
                inner.exec_module(module)
                then(module)
        spec.loader = Loader()
        return spec


def when_imported(name: str, then: Callable[[ModuleType], None]) -> None:
    """Call `then(module)` once module `name` has executed: now if it is imported already, else
    right after its import."""
    if name in sys.modules:
        then(sys.modules[name])
        return
    sys.meta_path.insert(0, ImportHook(lambda fullname: fullname == name, then, once=True))
