"""NIXL tuning for the pdgate real-engine e2e test (loaded via PYTHONPATH).

NIXL 1.5.1's Python API creates its agent with ``pthrDelay = 0``: the UCX
progress thread then busy-polls a whole core per engine, which on a 2-core
machine stretches vLLM start-up to minutes and request latency to seconds.

vLLM's CPU platform starts its engine core with the ``spawn`` method, so a patch
applied in the launching process would not reach it. This file is imported by
every Python process started with ``tests/e2e/pyhooks`` on ``PYTHONPATH``; it
adds an import hook that, once NIXL's ``_api`` module has executed, swaps its
view of the native bindings for one that raises ``pthrDelay`` on each new
agent config. Nothing installed is modified, and nothing is imported eagerly.
"""

import importlib.abc
import os
import sys
import types

# Microseconds, like the binding's own lthrDelay (100000 = 100 ms).
_DELAY_US = int(os.environ.get("PDGATE_E2E_NIXL_PTHR_DELAY_US", "1000"))
_TARGETS = frozenset({"nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api", "nixl._api"})


class _BindingsWithDelay(types.ModuleType):
    """Delegates to the real NIXL bindings, raising pthrDelay on new agents."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__(real.__name__)
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def nixlAgent(self, name, config):
        config.pthrDelay = max(config.pthrDelay, _DELAY_US)
        return self._real.nixlAgent(name, config)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        real = getattr(module, "nixlBind", None)
        if isinstance(real, types.ModuleType) and not isinstance(real, _BindingsWithDelay):
            module.nixlBind = _BindingsWithDelay(real)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


if _DELAY_US > 0 and not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
