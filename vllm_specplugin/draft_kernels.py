"""vLLM's own CPU kernels for the drafts' lean forward (``proposers/lean_llama.py``).

A draft step at batch 1 is a chain of small operations, each worth microseconds:

- matrix products whose weights the target's step in between has pushed out of the cache, so
  they stream from memory. vLLM's CPU linear layers prepack each weight once into oneDNN's
  blocked layout (``vllm._custom_ops.create_onednn_mm`` / ``onednn_mm``; see
  ``model_executor/layers/utils.py: dispatch_cpu_unquantized_gemm``), which streams about twice
  as fast as the row-major weight ``torch.nn.functional.linear`` reads (4.46 M-parameter draft,
  one thread, weights cold: 0.59–0.74 ms against 1.34–1.40 ms per forward of matrix products);
- RMSNorm (with the residual add), RoPE and SiLU-and-mul, which torch runs as 4–10 dispatched
  operations each and vLLM's C++ kernels (``torch.ops._C.rms_norm``, ``fused_add_rms_norm``,
  ``rotary_embedding``, ``silu_and_mul``, what vLLM's compiled CPU models call) as one
  (measured, one thread, hidden 256: RMSNorm 7.7 → 1.8 µs, RoPE on 8 heads 15.9 → 2.1 µs).

The numbers differ from torch's only by float rounding, and exactness does not depend on them:
the q handed to the verifier is the distribution the draft sampled from, whatever produced its
logits. ``draft_kernels`` (plugin config) chooses: ``auto`` | ``vllm`` | ``torch``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from vllm_specplugin.config import DRAFT_KERNELS
from vllm_specplugin.proposers.lean_decode import OutKernels
from vllm_specplugin.proposers.lean_llama import LeanKernels

logger = logging.getLogger(__name__)

KERNEL_DTYPES = ("float32", "bfloat16")
PRIMITIVE_CACHE_SIZE = 32  # oneDNN primitives kept per weight (one per row count seen), as vLLM's layers
_C_OPS = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul")


def vllm_kernels_available() -> str | None:
    """None when vLLM's CPU kernels can be used here, else why not."""
    try:
        from vllm import _custom_ops as ops
    except Exception as error:  # noqa: BLE001 - any import failure means "not here"
        return f"vllm._custom_ops does not import ({error})"
    if not getattr(ops, "_supports_onednn", False):
        return "this vLLM build has no oneDNN GEMM (torch.ops._C.create_onednn_mm_handler)"
    if not (callable(getattr(ops, "create_onednn_mm", None)) and callable(getattr(ops, "onednn_mm", None))):
        return "vllm._custom_ops has no create_onednn_mm / onednn_mm"
    missing = [name for name in _C_OPS if not hasattr(torch.ops._C, name)]
    if missing:
        return f"this vLLM build has no torch.ops._C.{', '.join(missing)}"
    return None


_DTYPE_PROBES: dict[str, str | None] = {}


def vllm_kernels_run(dtype: str) -> str | None:
    """None when vLLM's CPU kernels run drafts in ``dtype`` on this CPU, else why not (probed once
    per dtype on tiny tensors). oneDNN needs AVX-512 (BF16) or AMX for bfloat16 products: on an
    AVX2-only CPU ``create_onednn_mm`` raises "could not create a primitive descriptor for the
    matmul primitive", which the draft would otherwise hit at start-up."""
    if dtype not in _DTYPE_PROBES:
        why_not = vllm_kernels_available()
        if why_not is None:
            try:
                torch_dtype = getattr(torch, dtype)
                x = torch.ones(1, 16, dtype=torch_dtype)
                onednn_linear(torch.ones(16, 16, dtype=torch_dtype))(x)
                _rms_norm(x, torch.ones(16, dtype=torch_dtype), 1e-6)
                _silu_and_mul(torch.ones(1, 32, dtype=torch_dtype))
            except RuntimeError as error:
                why_not = (f"vLLM's CPU kernels cannot run {dtype} on this CPU ({str(error).split('. ')[0]}; "
                           "oneDNN's bfloat16 products need AVX-512 or AMX)")
        _DTYPE_PROBES[dtype] = why_not
    return _DTYPE_PROBES[dtype]


def onednn_linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A ``LinearFactory``: ``weight`` [out, in] (float32 or bfloat16, CPU) prepacked once;
    returns x [T, in] -> [T, out] in x's dtype (x must have the weight's dtype), with
    ``.into(x, out)``: the same product written into ``out`` [T, out] (the lean forward's one-row
    fast path, ``proposers/lean_decode.py``)."""
    from vllm import _custom_ops as ops

    handler = ops.create_onednn_mm(weight.t(), PRIMITIVE_CACHE_SIZE)
    handler_tensor = handler.handler_tensor
    mm = torch.ops._C.onednn_mm

    def linear(x: torch.Tensor) -> torch.Tensor:
        return ops.onednn_mm(handler, x, None)

    linear.into = lambda x, out: mm(out, x, None, handler_tensor)
    linear.handler = handler  # owns the prepacked primitive (freed when collected)
    return linear


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x.contiguous(), weight, eps)
    return out


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    # In place: residual += x, then x = norm(residual) * weight.
    torch.ops._C.fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def _make_rope(cos: torch.Tensor, sin: torch.Tensor):
    # vLLM's table is [positions, head_dim]: cos of the first half's angles, then sin (NeoX layout,
    # the rotate-half convention of Llama); the lean forward's tables repeat each half.
    half = cos.shape[1] // 2
    head_dim = cos.shape[1]
    table = torch.cat([cos[:, :half], sin[:, :half]], -1).contiguous()

    def rope(positions: torch.Tensor, qk: torch.Tensor, q_size: int) -> torch.Tensor:
        # The kernel reads heads from 2-D [T, heads * head_dim] views (row stride free), and needs
        # a key (vLLM's own CPU RoPE falls back to torch without one).
        torch.ops._C.rotary_embedding(positions, qk[:, :q_size], qk[:, q_size:], head_dim, table, True)
        return qk.view(qk.shape[0], -1, head_dim)

    return rope


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    torch.ops._C.silu_and_mul(out, gate_up)
    return out


VLLM_CPU_KERNELS = LeanKernels("vllm", onednn_linear, _rms_norm, _add_rms_norm, _make_rope, _silu_and_mul)


def _rms_norm_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    torch.ops._C.rms_norm(out, x, weight, eps)


def _silu_and_mul_into(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    torch.ops._C.silu_and_mul(out, gate_up)


# The out forms the one-row fast path writes through (proposers/lean_decode.py).
VLLM_OUT_KERNELS = OutKernels("vllm", _rms_norm_into, _silu_and_mul_into)


def draft_out_kernels(kernels: LeanKernels | None) -> OutKernels | None:
    """The out forms matching ``kernels`` (what :func:`draft_kernels` chose): vLLM's for vLLM's
    kernels, None (torch's) otherwise."""
    return VLLM_OUT_KERNELS if kernels is VLLM_CPU_KERNELS else None


def draft_kernels(choice: str, device: torch.device | str, dtype: str = "float32") -> LeanKernels | None:
    """The kernels for ``draft_kernels`` = ``choice``, drafts in ``dtype`` on ``device``, or None
    for torch's (the lean forward's default).

    ``auto``: vLLM's CPU kernels for float32 / bfloat16 drafts on CPU where this vLLM has them
    and they run that dtype on this CPU (:func:`vllm_kernels_run`), else torch (a CPU fallback is
    logged). ``vllm``: vLLM's or a clear error. ``torch``: torch's.
    """
    if choice not in DRAFT_KERNELS:
        raise ValueError(f"draft_kernels must be one of {DRAFT_KERNELS}, got {choice!r}")
    if choice == "torch":
        return None
    device = torch.device(device)
    if device.type != "cpu":
        why_not = f"the drafts run on {device.type} (these are vLLM's CPU kernels)"
    elif dtype not in KERNEL_DTYPES:
        why_not = f"draft_dtype {dtype} (vLLM's CPU kernels here take {' or '.join(KERNEL_DTYPES)})"
    else:
        why_not = vllm_kernels_run(dtype)
    if why_not is None:
        return VLLM_CPU_KERNELS
    if choice == "vllm":
        raise ValueError(f"draft_kernels 'vllm' is not available: {why_not}")
    if device.type == "cpu" and dtype in KERNEL_DTYPES:
        logger.warning("specplugin: the drafts' lean forward falls back to torch's kernels: %s", why_not)
    return None
