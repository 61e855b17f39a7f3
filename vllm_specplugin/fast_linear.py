"""oneDNN's prepacked matrix products for the drafts' lean forward on CPU (vLLM's own GEMM path).

A draft step at batch 1 multiplies vectors by every weight of the draft, and the target's step in
between has pushed those weights out of the cache, so the step streams them from memory. vLLM's
CPU linear layers prepack each weight once into oneDNN's blocked layout
(``vllm._custom_ops.create_onednn_mm`` / ``onednn_mm``; see
``model_executor/layers/utils.py: dispatch_cpu_unquantized_gemm``), which streams about twice as
fast as the row-major weight ``torch.nn.functional.linear`` reads (4.46 M-parameter draft, one
thread, weights cold: 0.59–0.74 ms against 1.34–1.40 ms per forward of matrix products). The
drafts use the same kernels, through :data:`vllm_specplugin.proposers.lean_llama.LinearFactory`.

The numbers differ from ``F.linear`` only by float rounding (summation order), and exactness does
not depend on them: the q handed to the verifier is the distribution the draft sampled from,
whatever produced its logits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

DRAFT_GEMMS = ("auto", "onednn", "torch")
PRIMITIVE_CACHE_SIZE = 32  # oneDNN primitives kept per weight (one per row count seen), as vLLM's layers


def onednn_available() -> str | None:
    """None when vLLM's oneDNN products can be used here, else why not."""
    try:
        from vllm import _custom_ops as ops
    except Exception as error:  # noqa: BLE001 - any import failure means "not here"
        return f"vllm._custom_ops does not import ({error})"
    if not getattr(ops, "_supports_onednn", False):
        return "this vLLM build has no oneDNN GEMM (torch.ops._C.create_onednn_mm_handler)"
    if not (callable(getattr(ops, "create_onednn_mm", None)) and callable(getattr(ops, "onednn_mm", None))):
        return "vllm._custom_ops has no create_onednn_mm / onednn_mm"
    return None


def onednn_linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A :data:`LinearFactory`: ``weight`` [out, in] (float32 or bfloat16, CPU) prepacked once;
    returns x [T, in] -> [T, out] in x's dtype (x must have the weight's dtype)."""
    from vllm import _custom_ops as ops

    handler = ops.create_onednn_mm(weight.t(), PRIMITIVE_CACHE_SIZE)
    return lambda x: ops.onednn_mm(handler, x, None)


onednn_linear.name = "onednn"  # type: ignore[attr-defined]


ONEDNN_DTYPES = ("float32", "bfloat16")


def draft_linear_factory(choice: str, device: torch.device | str, dtype: str = "float32"):
    """The :data:`LinearFactory` for ``draft_gemm`` = ``choice``, drafts in ``dtype`` on ``device``,
    or None for torch's ``F.linear``.

    ``auto``: oneDNN for float32 / bfloat16 drafts on CPU where this vLLM has it, else torch (a
    CPU fallback is logged). ``onednn``: oneDNN or a clear error. ``torch``: ``F.linear``.
    """
    if choice not in DRAFT_GEMMS:
        raise ValueError(f"draft_gemm must be one of {DRAFT_GEMMS}, got {choice!r}")
    if choice == "torch":
        return None
    device = torch.device(device)
    if device.type != "cpu":
        why_not = f"the drafts run on {device.type} (oneDNN products are vLLM's CPU path)"
    elif dtype not in ONEDNN_DTYPES:
        why_not = f"draft_dtype {dtype} (oneDNN products here take {' or '.join(ONEDNN_DTYPES)})"
    else:
        why_not = onednn_available()
    if why_not is None:
        return onednn_linear
    if choice == "onednn":
        raise ValueError(f"draft_gemm 'onednn' is not available: {why_not}")
    if device.type == "cpu" and dtype in ONEDNN_DTYPES:
        logger.warning("specplugin: draft matrix products fall back to torch's F.linear: %s", why_not)
    return None
