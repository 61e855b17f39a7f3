"""Draft-side sampling with the request's own processing, so q is the distribution drafted from.

q stays float32 (it is what vLLM's rejection sampler receives as draft probabilities, [.., V]
float32), but every draw is exact with respect to q's float64 values: a float32 cumulative sum
over a large vocabulary rounds away the mass of small tokens once the running sum passes 0.5
(at V = 152k, up to ~3e-4 of the mass could never be drawn, all of it on high token ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_EPSILON = 1e-5  # vLLM treats temperature below this as greedy


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0  # 1.0: off

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p, as vLLM's sampler applies them; float32 probs [..., V].

    Greedy requests get the one-hot at the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - params.top_p
        drop[..., -1] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(-1)


def processed_probs_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """:func:`processed_probs` for a batch [B, V] whose rows have their own parameters."""
    rows_by_params: dict[SamplingParams, list[int]] = {}
    for row, p in enumerate(params):
        rows_by_params.setdefault(p, []).append(row)
    if len(rows_by_params) == 1:
        return processed_probs(logits, params[0])  # one group: no gather and scatter
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for p, rows in rows_by_params.items():
        index = torch.tensor(rows, device=logits.device)
        out[index] = processed_probs(logits[index], p)
    return out


def cdf_rows(probs: torch.Tensor) -> torch.Tensor:
    """Float64 running sums of ``probs`` [B, V] (any float dtype) -> [B, V] float64.

    Token i owns the points in [cdf[i-1], cdf[i]) (0 before token 0), an interval whose length is
    q_i to within one float64 rounding (~1e-16), so every token with q > 0 is reachable with
    its own probability and a token with q = 0 owns an empty interval.
    """
    return probs.double().cumsum(-1)  # same values as cumsum(dtype=float64), and faster on CPU


def invert_cdf(cdf: torch.Tensor, points: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The tokens owning ``points`` [B, K] (float64, in [0, cdf[:, -1]]) under ``cdf`` [B, V] from
    :func:`cdf_rows`: for each point u the i with cdf[i-1] <= u < cdf[i]. Returns [B, K] int64.

    ``probs`` [B, V] is only read on the ~2^-53-probability path where a point lands on the
    row's total itself (a uniform of 1 - 2^-53 rounded up): it goes to the last token with q > 0.
    """
    tokens = torch.searchsorted(cdf, points, right=True)
    past_end = tokens >= cdf.shape[-1]
    if past_end.any():
        last_nonzero = probs.shape[-1] - 1 - (probs > 0).flip(-1).to(torch.uint8).argmax(-1, keepdim=True)
        tokens = torch.where(past_end, last_nonzero, tokens)
    return tokens


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``probs`` [B, V] (float32 q), exactly from q / sum(q): [B] int64.

    Inverse CDF in float64 with one float64 uniform per row (53 random bits): far cheaper than
    per-token noise over a whole vocabulary. Rows with a generator draw their uniform from it
    (seeded requests), the others from torch's default generator.
    """
    uniform = torch.rand(probs.shape[0], dtype=torch.float64, device=probs.device)
    seeded = [row for row, generator in enumerate(generators) if generator is not None]
    if seeded:
        uniform[torch.tensor(seeded, device=probs.device)] = torch.cat([
            torch.rand(1, dtype=torch.float64, generator=generators[row], device=probs.device) for row in seeded
        ])
    cdf = cdf_rows(probs)
    points = uniform[:, None] * cdf[:, -1:]  # q sums to 1 only to float32 accuracy: draw q / sum(q)
    return invert_cdf(cdf, points, probs).squeeze(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs`` [..., V], every row drawing from ``generator``; [...] int64.

    Same exact float64 inversion as :func:`sample_rows` (``torch.multinomial`` draws a single
    sample by racing float32 exponentials, which discretises small probabilities).
    """
    flat = probs.reshape(-1, probs.shape[-1])
    return sample_rows(flat, [generator] * flat.shape[0]).reshape(probs.shape[:-1])


# -- the draft stream of a seeded request --------------------------------------------------------

_MT_WORDS = 624  # mt19937's state: 624 32-bit words
_MT_STATE_BYTES = slice(24, 24 + 8 * _MT_WORDS)  # in torch's CPU generator state (uint64 per word)


def draft_generator(seed: int, device="cpu") -> torch.Generator:
    """The generator a seeded request drafts from: reproducible from ``seed``, and never the stream
    of the target's generator for any request seed.

    vLLM gives a seeded request ``torch.Generator().manual_seed(seed)``. On the CPU that stream
    depends only on ``seed % 2**32`` (torch's mt19937), so *any* ``manual_seed`` value is some
    request's target stream (the old ``seed * 0x9E3779B1 + 1`` made seed 0 draft with seed 1's
    numbers). Instead the 624 state words are filled from SHA-256 of the seed: such a state does
    not satisfy mt19937's seeding recurrence, so it is no seeded state, and the chance that it lies
    within 2**64 draws of one of the 2**32 seeded streams is below 2**-19800. On CUDA (Philox:
    seed + offset) the draft stream starts at offset 2**62 of the seed's stream, which no request
    reaches (untested without a GPU).
    """
    import hashlib

    import numpy as np

    seed_bytes = int(seed).to_bytes(16, "little", signed=True)
    device = torch.device(device)
    if device.type != "cpu":
        generator = torch.Generator(device=device)
        generator.manual_seed(int.from_bytes(hashlib.sha256(b"specplugin-draft" + seed_bytes).digest()[:8], "little") >> 1)
        generator.set_offset(1 << 62)
        return generator
    words = np.frombuffer(b"".join(hashlib.sha256(b"specplugin-draft" + seed_bytes + i.to_bytes(4, "little")).digest()
                                   for i in range(_MT_WORDS // 8)), dtype="<u4").astype("<u8")
    generator = torch.Generator().manual_seed(0)  # left = 1, next = 0: the first draw regenerates from the words
    state = generator.get_state().clone()
    state[_MT_STATE_BYTES] = torch.from_numpy(words.view(np.uint8).copy())
    generator.set_state(state)
    return generator


def is_seeded_mt19937_state(generator: torch.Generator) -> bool:
    """Whether a CPU generator's state words are those ``manual_seed`` makes (mt19937's recurrence
    state[i] = 1812433253 * (state[i-1] ^ (state[i-1] >> 30)) + i, mod 2**32)."""
    import numpy as np

    words = generator.get_state()[_MT_STATE_BYTES].numpy().view("<u8").astype(np.uint64)
    prev = int(words[0])
    for i in range(1, _MT_WORDS):
        expected = (1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF
        if int(words[i]) != expected:
            return False
        prev = expected
    return True
