"""Repair of vLLM 0.32's compile cache on CPU: every engine start compiled the model again.

vLLM saves the compiled model (``torch.compiler`` precompile, "AOT compile") under
``VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<hash>`` and loads it at the next start
(``compilation/decorators.py: _try_load_aot_compiled_fn``). After loading, it calls
``loaded_fn._artifacts.compiled_fn.finalize_loading(vllm_config)``, a method of vLLM's own
``VllmSerializableFunction`` (the piecewise backend used on GPUs). On CPU vLLM compiles with the
stock ``inductor`` backend, which torch wraps as ``BundledAOTAutogradSerializableCallable``; its
deserializer returns that wrapper around the compiled function, already fully loaded, and forwards
attribute lookups to the function, which has no ``finalize_loading``. The load fails ("'function' object has no attribute
'finalize_loading'"), vLLM logs "Compiling model again" and compiles from scratch: about 25 s of
every engine start on a 2-core machine, for the target and again for a draft model.

The repair gives the deserialized wrapper the missing method as a no-op (there is nothing left to
load: the bundled artifact was deserialized whole), so vLLM's own load path completes and
"Directly load AOT compilation" appears in the log. Nothing else changes: vLLM still checks that
the model's source is unchanged (``_verify_source_unchanged``) and falls back to compiling on any
other failure. Version-guarded (vLLM 0.32.x, on CPU), off with ``SPECPLUGIN_COMPILE_CACHE_REPAIR=off``,
logged once per process that loads a compiled model, internals listed in ``compat.py``.
"""

from __future__ import annotations

import os

from vllm_specplugin import version
from vllm_specplugin.logging_utils import log_once

_MARK = "_specplugin_compile_cache_repair"
ENV = "SPECPLUGIN_COMPILE_CACHE_REPAIR"


def _already_loaded(vllm_config) -> None:
    """``finalize_loading`` for a compiled function torch deserialized whole: nothing to finalize."""


def _with_finalize_loading(original):
    def deserialize_compile_artifacts(cls, data: bytes):
        fn = original(cls, data)
        if not hasattr(fn, "finalize_loading"):
            try:
                fn.finalize_loading = _already_loaded
            except (AttributeError, TypeError):  # no instance attributes: vLLM compiles again, as before
                return fn
            log_once("info", "Repaired vLLM 0.32's compile cache on CPU: the saved compiled model is loaded instead "
                             "of compiled again at every engine start (vllm_specplugin/compile_cache_repair.py).")
        return fn

    return deserialize_compile_artifacts


def apply() -> bool:
    """Install the repair where it is needed (vLLM 0.32.x on CPU, unless ``SPECPLUGIN_COMPILE_CACHE_REPAIR=off``).
    Returns True when it is installed (idempotent)."""
    if os.environ.get(ENV, "auto") == "off" or not version.is_tested_version():
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled

    current = Bundled.__dict__["deserialize_compile_artifacts"]
    if getattr(current.__func__, _MARK, False):
        return True
    wrapper = _with_finalize_loading(current.__func__)
    setattr(wrapper, _MARK, True)
    Bundled.deserialize_compile_artifacts = classmethod(wrapper)
    return True
