"""The exact reference: the target's processed next-token distributions, from transformers.

For each prefix the engine produced, the checkpoint is run teacher-forced in float32 and the
logits are processed the way vLLM's sampler processes them — temperature, then top-k, then
top-p (``verification.algorithm.process_logits``) — in float64.

Greedy (T = 0) and near-ties. vLLM computes its logits with its own float32 kernels, the
reference with transformers' float32 ones: the two differ by float32 rounding. Measured on the
statistical tier's peaked target (vLLM plain greedy decoding, 32 prompts x 32 tokens, top-5
logprobs): |vLLM logprob - reference log-softmax| <= 7.1e-6 (median 1.0e-6), and the smallest
top-1/top-2 logit gap met was 2.8e-3. When the two largest logits are closer than the rounding,
the engine's argmax may legitimately be the reference's runner-up, so at T = 0 the reference
accepts every token whose logit is within ``tie_tolerance`` (default ``GREEDY_TIE_TOLERANCE`` =
1e-4, 7x the largest logit-gap error the measurement allows) of the maximum; the check reports how
many nodes had such a near-tie and how many sampled tokens were accepted only thanks to it
(``ProcessedConditionals.near_tie``; 0 and 0 in every run of the tier so far).

``sample_tree`` draws continuations from an exact law (the target, or a speculative rule's law
built with ``verification.algorithm.speculative_token_law``) without any engine: the statistical
tier uses it to size N (the df of the decision) and to compute a fault's power at its effect.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from vllm_specplugin.verification.algorithm import SAMPLING_EPS, process_logits

# Absolute logit gap under which two tokens count as tied at T = 0 (see the module docstring).
GREEDY_TIE_TOLERANCE = 1e-4

Prefix = tuple[int, ...]
# law(prefixes) -> probabilities [len(prefixes), V] of the next token after prompt + prefix
BatchLaw = Callable[[list[Prefix]], np.ndarray]


class TargetReference:
    """A checkpoint loaded with transformers in float32, for teacher-forced next-token logits."""

    def __init__(self, model_path: str, batch_size: int = 512):
        import torch
        from transformers import AutoModelForCausalLM

        self.model_path = model_path
        self.batch_size = batch_size
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.vocab_size = int(self.model.config.vocab_size)

    def prefix_logits(self, prompt: Sequence[int], samples: np.ndarray) -> dict[tuple[int, ...], np.ndarray]:
        """Raw float32 logits after ``prompt + prefix`` for every prefix (depth < m) of ``samples``."""
        import torch

        samples = np.asarray(samples, dtype=np.int64)
        m = samples.shape[1]
        unique = np.unique(samples, axis=0)
        logits_by_prefix: dict[tuple[int, ...], np.ndarray] = {}
        prompt_t = torch.tensor(list(prompt), dtype=torch.long)
        for start in range(0, len(unique), self.batch_size):
            chunk = torch.from_numpy(unique[start : start + self.batch_size])
            inputs = torch.cat([prompt_t.expand(len(chunk), -1), chunk[:, : m - 1]], dim=1)
            with torch.no_grad():
                logits = self.model(input_ids=inputs).logits[:, len(prompt) - 1 :, :].float().numpy()
            for row, seq in enumerate(chunk.tolist()):
                for depth in range(m):
                    logits_by_prefix.setdefault(tuple(seq[:depth]), logits[row, depth])
        return logits_by_prefix

    def next_logits(self, prompt: Sequence[int], prefixes: Sequence[Prefix]) -> np.ndarray:
        """Raw float32 logits after ``prompt + prefix`` for each prefix, ``[len(prefixes), V]``.

        Prefixes of equal length are batched together.
        """
        import torch

        out = np.empty((len(prefixes), self.vocab_size), dtype=np.float32)
        by_length: dict[int, list[int]] = {}
        for i, prefix in enumerate(prefixes):
            by_length.setdefault(len(prefix), []).append(i)
        for length, rows in by_length.items():
            for start in range(0, len(rows), self.batch_size):
                chunk = rows[start : start + self.batch_size]
                inputs = torch.tensor([list(prompt) + list(prefixes[i]) for i in chunk], dtype=torch.long)
                with torch.no_grad():
                    out[chunk] = self.model(input_ids=inputs).logits[:, -1, :].float().numpy()
        return out


class ProcessedConditionals:
    """``conditional(prefix) -> probs``: the request's processed target distribution.

    At T = 0 the "distribution" is uniform over the near-tied maxima (one token, except within
    ``tie_tolerance`` of a tie): it is only used for the support check.
    """

    def __init__(self, logits_by_prefix, temperature: float, top_k: int, top_p: float,
                 tie_tolerance: float = GREEDY_TIE_TOLERANCE):
        self._logits = logits_by_prefix
        self._params = (temperature, top_k, top_p)
        self.greedy = temperature < SAMPLING_EPS
        self.tie_tolerance = float(tie_tolerance)
        self._cache: dict[tuple[int, ...], np.ndarray] = {}

    def __call__(self, prefix: tuple[int, ...]) -> np.ndarray:
        prefix = tuple(prefix)
        if prefix not in self._cache:
            logits = self._logits[prefix].astype(np.float64)
            if self.greedy:
                acceptable = logits >= logits.max() - self.tie_tolerance
                self._cache[prefix] = acceptable / acceptable.sum()
            else:
                self._cache[prefix] = process_logits(logits, *self._params)
        return self._cache[prefix]

    def near_tie(self, prefix: tuple[int, ...], token: int) -> tuple[bool, bool]:
        """At T = 0: (the node has several acceptable tokens, ``token`` is acceptable but is not the
        exact argmax of the reference's logits)."""
        logits = self._logits[tuple(prefix)]
        tied = int(np.count_nonzero(logits >= logits.max() - self.tie_tolerance)) > 1
        return tied, bool(tied and token != int(np.argmax(logits)) and self(prefix)[token] > 0)


def target_law(reference: TargetReference, prompt: Sequence[int], temperature: float, top_k: int = 0,
               top_p: float = 1.0) -> BatchLaw:
    """The exact processed target after ``prompt + prefix``, as a batch law (cached)."""
    cache: dict[Prefix, np.ndarray] = {}

    def law(prefixes: list[Prefix]) -> np.ndarray:
        missing = [s for s in dict.fromkeys(prefixes) if s not in cache]
        if missing:
            for s, row in zip(missing, reference.next_logits(prompt, missing)):
                cache[s] = process_logits(row.astype(np.float64), temperature, top_k, top_p)
        return np.stack([cache[s] for s in prefixes])

    return law


def sample_tree(law: BatchLaw, n: int, m: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` exact draws of ``m`` tokens from ``law``, position by position, shape ``(n, m)``.

    The law is evaluated once per distinct prefix (inverse-CDF draws in float64).
    """
    samples = np.zeros((n, m), dtype=np.int64)
    for depth in range(m):
        keys = [tuple(row) for row in samples[:, :depth].tolist()]
        unique = list(dict.fromkeys(keys))
        index = {s: i for i, s in enumerate(unique)}
        probs = law(unique)
        cdf = np.cumsum(probs, axis=1)
        rows = np.array([index[s] for s in keys])
        u = rng.random(n) * cdf[rows, -1]
        tokens = np.array([np.searchsorted(cdf[r], x, side="right") for r, x in zip(rows, u)])
        tokens = np.minimum(tokens, probs.shape[1] - 1)
        # rounding at the top of a CDF: step back to the last token with positive mass
        for i in np.nonzero(probs[rows, tokens] <= 0)[0]:
            tokens[i] = int(np.flatnonzero(probs[rows[i]])[-1])
        samples[:, depth] = tokens
    return samples
