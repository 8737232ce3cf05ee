"""vLLM general plugin: vLLM's KV-cache writes run on kvwrite's bounds-checked stores.

Registered as `kvwrite = kvwrite.integrations.vllm:register` in the `vllm.general_plugins`
entry-point group, so every vLLM process (engine core, workers) loads it. `register()` replaces
the cache writers vLLM calls through `vllm._custom_ops` — `cpu_attn_reshape_and_cache` (CPU
attention backend), `reshape_and_cache_flash` (flash / FlashInfer / Triton backends),
`reshape_and_cache` (legacy head-major), `concat_and_cache_mla` (MLA) — and the Triton writer
`triton_reshape_and_cache_flash`, by `kvwrite.compat.vllm`'s adapters with the same arguments.

`KVWRITE_CHECK` (off | assert | guard) picks the check mode as everywhere in kvwrite. In guard
mode a bad slot is skipped and recorded, and the plugin raises `kvwrite.OutOfBoundsWrite`
(token index, slot, block) right after the store that recorded it, before anything reads the
cache: one host read of the error buffer per store in guard mode (a device sync on a GPU).
`KVWRITE_VLLM_PLUGIN=0` leaves vLLM untouched; `KVWRITE_VLLM_BACKEND` picks kvwrite's backend
("auto" by default). The vLLM version (for behaviour that changed between releases, see
`kvwrite.compat.vllm.VLLM_VERSION`) is taken from the running vLLM.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable

ENABLE_ENV = "KVWRITE_VLLM_PLUGIN"
BACKEND_ENV = "KVWRITE_VLLM_BACKEND"

# (module, attribute) of each vLLM writer and the kvwrite.compat.vllm adapter that replaces it.
ROUTES = (
    ("vllm._custom_ops", "cpu_attn_reshape_and_cache", "cpu_attn_reshape_and_cache"),
    ("vllm._custom_ops", "reshape_and_cache_flash", "reshape_and_cache_flash"),
    ("vllm._custom_ops", "reshape_and_cache", "reshape_and_cache"),
    ("vllm._custom_ops", "concat_and_cache_mla", "concat_and_cache_mla"),
    ("vllm.v1.attention.ops.triton_reshape_and_cache_flash", "triton_reshape_and_cache_flash",
     "reshape_and_cache_flash"),
)


@dataclass
class Installed:
    """What `install` replaced (module.attr -> the original), for `uninstall` and reports."""

    originals: dict[str, tuple[Any, str, Callable]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)


STATE = Installed()


def routed(name: str, adapter: Callable, backend: str, state: Installed) -> Callable:
    """A vLLM-signature writer running `adapter`; in guard mode raises the recorded error."""
    from kvwrite import validate
    from kvwrite.errors import ErrorBuffer

    buffers: dict[Any, ErrorBuffer] = {}

    def write(*args, **kwargs):
        state.calls[name] = state.calls.get(name, 0) + 1
        mode = validate.DEFAULT_CHECK
        if mode != "guard":
            return adapter(*args, check=mode, backend=backend, **kwargs)
        device = args[0].device
        errors = buffers.get(device)
        if errors is None:
            errors = buffers[device] = ErrorBuffer(device)
        adapter(*args, check="guard", errors=errors, backend=backend, **kwargs)
        err = errors.error()
        if err is not None:
            errors.reset()
            raise err

    write.__name__ = name
    write.__qualname__ = f"kvwrite.integrations.vllm.{name}"
    write.__wrapped_adapter__ = adapter
    return write


def install(import_module: Callable[[str], Any] = importlib.import_module,
            adapters: Any = None, backend: str | None = None,
            state: Installed | None = None) -> Installed:
    """Replace every writer in ROUTES that the running vLLM has (modules from `import_module`,
    adapters from `adapters`, default kvwrite.compat.vllm); idempotent."""
    state = STATE if state is None else state
    if adapters is None:
        from kvwrite.compat import vllm as adapters
    backend = backend or os.environ.get(BACKEND_ENV, "auto")
    for module_name, attr, adapter_name in ROUTES:
        key = f"{module_name}.{attr}"
        if key in state.originals:
            continue
        try:
            module = import_module(module_name)
        except ImportError as exc:
            state.skipped[key] = f"module not importable ({exc})"
            continue
        if not hasattr(module, attr):
            state.skipped[key] = "not in this vLLM"
            continue
        state.originals[key] = (module, attr, getattr(module, attr))
        setattr(module, attr, routed(attr, getattr(adapters, adapter_name), backend, state))
    return state


def uninstall(state: Installed | None = None) -> None:
    """Put vLLM's own writers back."""
    state = STATE if state is None else state
    for module, attr, original in state.originals.values():
        setattr(module, attr, original)
    state.originals.clear()


def _vllm_version(import_module: Callable[[str], Any]) -> str | None:
    try:
        return getattr(import_module("vllm"), "__version__", None)
    except ImportError:
        return None


def register() -> None:
    """The `vllm.general_plugins` entry point: install unless KVWRITE_VLLM_PLUGIN=0."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return
    from kvwrite.compat import vllm as adapters

    version = _vllm_version(importlib.import_module)
    if version and not os.environ.get("KVWRITE_VLLM_VERSION"):
        try:
            adapters.version_tuple(version)
            adapters.VLLM_VERSION = version
        except ValueError:
            pass
    install()
