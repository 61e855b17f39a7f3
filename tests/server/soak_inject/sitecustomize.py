"""Faults for testing the soak's own checks, injected into the server's processes only when
SPECPLUGIN_SOAK_INJECT is set (this folder goes on the server's PYTHONPATH; Python imports
``sitecustomize`` at start-up in every process, spawned workers included).

SPECPLUGIN_SOAK_INJECT is a comma-separated list of:
  leak=MIB_PER_MIN  the worker process (comm VLLM::Worker) holds MIB_PER_MIN more MiB each minute;
  tracked=N         the proposer's metrics snapshot reports N more tracked requests than it holds;
  exit_after=N      the API server process exits at its N-th request (a crash mid-load);
  drop_token        the front end asks the engine for one token less than the request's max_tokens
                    (requests with max_tokens >= 8 divisible by 5), so those responses end one
                    token short with finish_reason "length".
Nothing happens without the variable.
"""

import os

_SPEC = os.environ.get("SPECPLUGIN_SOAK_INJECT", "")

if _SPEC:
    import importlib.abc
    import importlib.util
    import sys
    import threading
    import time

    _faults = dict(item.partition("=")[::2] for item in _SPEC.split(",") if item)

    class _AfterImport(importlib.abc.MetaPathFinder):
        """Runs ``patch(module)`` right after ``name`` is first imported."""

        def __init__(self, name, patch):
            self.name, self.patch = name, patch

        def find_spec(self, fullname, path, target=None):
            if fullname != self.name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            original, patch = spec.loader.exec_module, self.patch

            def exec_module(module):
                original(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    if "leak" in _faults:
        mib_per_min = float(_faults["leak"])

        def _leak():
            held = []
            while True:
                time.sleep(1.0)
                try:
                    with open("/proc/self/comm") as f:
                        if not f.read().startswith("VLLM::Worker"):
                            continue
                except OSError:
                    return
                held.append(b"\x01" * int(mib_per_min * 1024 * 1024 / 60))  # touched pages: resident

        threading.Thread(target=_leak, name="soak-inject-leak", daemon=True).start()

    if "tracked" in _faults:
        extra = int(_faults["tracked"])

        def _patch_metrics(module):
            snapshot = module.DraftMetrics.snapshot

            def patched(self, *args, **kwargs):
                out = snapshot(self, *args, **kwargs)
                out["tracked_requests"] = out.get("tracked_requests", 0) + extra
                return out

            module.DraftMetrics.snapshot = patched

        sys.meta_path.insert(0, _AfterImport("vllm_specplugin.proposers.metrics", _patch_metrics))

    if "exit_after" in _faults:
        limit = int(_faults["exit_after"])
        seen = [0]

        def _patch_exit(module):
            from_optional = module.SamplingParams.from_optional

            def patched(*args, **kwargs):
                seen[0] += 1
                if seen[0] >= limit:
                    os._exit(1)
                return from_optional(*args, **kwargs)

            module.SamplingParams.from_optional = staticmethod(patched)

        sys.meta_path.insert(0, _AfterImport("vllm.sampling_params", _patch_exit))

    if "drop_token" in _faults:

        def _patch_sampling(module):
            # The OpenAI front end builds its SamplingParams with from_optional (msgspec caches
            # __post_init__ at class creation, so that hook cannot be swapped afterwards).
            from_optional = module.SamplingParams.from_optional  # a staticmethod

            def patched(*args, **kwargs):
                params = from_optional(*args, **kwargs)
                if params.max_tokens is not None and params.max_tokens >= 8 and params.max_tokens % 5 == 0:
                    params.max_tokens -= 1
                return params

            module.SamplingParams.from_optional = staticmethod(patched)

        sys.meta_path.insert(0, _AfterImport("vllm.sampling_params", _patch_sampling))
