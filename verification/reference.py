"""The exact reference: the target's processed next-token distributions, from transformers.

For each prefix the engine produced, the checkpoint is run teacher-forced in float32 and the
logits are processed the way vLLM's sampler processes them — temperature, then top-k, then
top-p (``verification.algorithm.process_logits``) — in float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm_specplugin.verification.algorithm import process_logits


class TargetReference:
    """A checkpoint loaded with transformers in float32, for teacher-forced next-token logits."""

    def __init__(self, model_path: str, batch_size: int = 512):
        import torch
        from transformers import AutoModelForCausalLM

        self.model_path = model_path
        self.batch_size = batch_size
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()

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


class ProcessedConditionals:
    """``conditional(prefix) -> probs``: the request's processed target distribution."""

    def __init__(self, logits_by_prefix, temperature: float, top_k: int, top_p: float):
        self._logits = logits_by_prefix
        self._params = (temperature, top_k, top_p)
        self._cache: dict[tuple[int, ...], np.ndarray] = {}

    def __call__(self, prefix: tuple[int, ...]) -> np.ndarray:
        prefix = tuple(prefix)
        if prefix not in self._cache:
            self._cache[prefix] = process_logits(self._logits[prefix].astype(np.float64), *self._params)
        return self._cache[prefix]
