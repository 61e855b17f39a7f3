"""Opt-in LOSSY acceptance modes for vLLM's rejection sampler (issue 15 part A).

Exact speculative sampling (the default, ``exact``) accepts a draft token x ~ q with probability
min(1, p(x)/q(x)) and otherwise emits y ~ norm(max(0, p - q)); the output is then exactly the
target's. The modes below trade that for longer accepted runs. **Their outputs do not follow the
target distribution**; the harness (``python -m vllm_specplugin.verification lossy-sweep``)
measures by how much.

- ``lenient`` (Leviathan et al. 2023, lenience l in (0, 1]): accept with min(1, p(x) / (l q(x))).
  l = 1 is exact; smaller l accepts more.
- ``typical`` (Medusa's typical acceptance, Cai et al. 2024): accept x iff
  p(x) > min(epsilon, delta * exp(-H(p))), H the entropy of the processed target p (exact, in
  float64; Medusa's code adds 1e-5 inside the log). Medusa's defaults: epsilon 0.09, delta 0.3
  (its README: delta = sqrt(epsilon)).

After the first rejection the token is drawn from the residual of the rule actually applied,
R = norm(max(0, p - q * A)), A(y) the rule's acceptance probability of token y. This is the
correction that brings the position's law q*A + (1 - sum q*A) R closest to p for a given rule;
for ``exact`` and ``lenient`` it is vLLM's own norm(max(0, p - q)); for ``typical`` it is always
defined (the plain residual can be empty there). Medusa itself samples the next token from the
typical-truncated target (``get_typical_one_token``: p restricted to p >= threshold), because its
candidates are deterministic, and vLLM V0's TypicalAcceptanceSampler took the target's argmax at
the first position. With one-hot drafts (no q) R is p with the rejected token removed (lenient) or
p itself (typical: the rejected token has p <= threshold). The bonus token after a fully accepted
draft is vLLM's, from p. At T = 0 every mode is exact (p is one-hot: both rules accept only the
argmax), so greedy rows are never touched.

Where the settings come from
----------------------------
- server-wide: ``--additional-config '{"specplugin": {"acceptance": {"mode": "lenient",
  "lenience": 0.5}}}'`` (keys ``mode``, ``lenience``, ``epsilon``, ``delta``, ``per_request``);
- per request: ``SamplingParams.extra_args`` (``vllm_xargs`` in the OpenAI API), flat keys
  ``specplugin_acceptance`` ("exact" | "lenient" | "typical"), ``specplugin_lenience``,
  ``specplugin_typical_epsilon``, ``specplugin_typical_delta``. A request's keys override the
  server's; ``"specplugin_acceptance": "exact"`` gets exact sampling on a lossy server. With
  ``per_request: false`` the server refuses per-request settings. Bad values are refused when the
  request is admitted (``InputProcessor._validate_params``: HTTP 400 with the message), never in
  the worker.

The patch (vLLM 0.32.x, listed in ``compat.py``)
-------------------------------------------------
``GPUModelRunner._sample`` is wrapped to resolve, per batch row, the request's setting
(``input_batch.req_ids[row]`` -> ``runner.requests[req_id].sampling_params.extra_args``, cached per
request id) into a list ``rows: list[Acceptance | None]`` (None: exact) kept for the duration of
the call. ``rejection_sampler.rejection_sample`` is wrapped: when no row of the step is lossy (the
default) it is vLLM's call, unchanged, with nothing else done. Otherwise vLLM's sampler runs for
the whole batch as usual and only the lossy rows of its output ``[batch, max_spec_len + 1]``
(int32, -1 after the emitted tokens) are recomputed, in float64, from the same inputs: target
logits ``[num_tokens, V]`` (processed: penalties, temperature, top-k, top-p), draft probabilities
``[num_tokens, V]`` float32 or None (one-hot), draft token ids ``[num_tokens]`` and vLLM's bonus
tokens ``[batch, 1]``. Exact rows keep vLLM's result bit for bit; a lossy row draws its uniforms
from its own generator when seeded. Not with ``rejection_sample_method`` other than "standard",
nor with tree verification (both refused at start-up or with HTTP 400).

Metrics: ``specplugin:lossy_drafted_tokens_total{mode}``, ``..._accepted_tokens_total{mode}``
(accepted under the lossy rule) and ``..._only_accepted_tokens_total{mode}`` (accepted although
the exact rule, with the same uniform, would have rejected them).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

import torch

# The acceptance settings' schema and parsing live with every other setting's, in config.py (the
# layer below); Acceptance, ServerAcceptance and Medusa's defaults are also read from here.
from vllm_specplugin.config import (  # noqa: F401 - MEDUSA_* re-exported
    ACCEPTANCE_MODES, ACCEPTANCE_PARAM_MODE, MEDUSA_DELTA, MEDUSA_EPSILON, Acceptance, ServerAcceptance,
    check_acceptance_params,
)
from vllm_specplugin.logging_utils import get_logger, log_once

logger = get_logger()

# extra_args key -> Acceptance field
REQUEST_KEYS = {
    "specplugin_acceptance": "mode",
    "specplugin_lenience": "lenience",
    "specplugin_typical_epsilon": "epsilon",
    "specplugin_typical_delta": "delta",
}
_MARK = "_specplugin_lossy"


class LossyRequestError(ValueError):
    """A request's ``specplugin_*`` extra arguments are invalid or not allowed on this server."""


def request_setting(extra_args: Mapping | None, server: ServerAcceptance) -> Acceptance:
    """The rule of one request: the server's, overridden by its ``specplugin_*`` extra arguments.
    Raises :class:`LossyRequestError` with a message for the client."""
    if not extra_args:
        return server.default
    ours = {k: v for k, v in extra_args.items() if isinstance(k, str) and k.startswith("specplugin_")}
    if not ours:
        return server.default
    unknown = sorted(set(ours) - set(REQUEST_KEYS))
    if unknown:
        raise LossyRequestError(f"unknown extra argument {unknown[0]!r}; the plugin reads {', '.join(REQUEST_KEYS)}")
    values = {REQUEST_KEYS[k]: v for k, v in ours.items()}
    mode = values.get("mode", server.default.mode)
    for name in values:
        if name in ACCEPTANCE_PARAM_MODE and mode != ACCEPTANCE_PARAM_MODE[name]:
            key = next(k for k, f in REQUEST_KEYS.items() if f == name)
            raise LossyRequestError(f"{key} applies to specplugin_acceptance={ACCEPTANCE_PARAM_MODE[name]!r}, "
                                    f"but the request's mode is {mode!r}")
    merged = dataclasses.asdict(server.default) | values
    if not isinstance(merged["mode"], str):
        raise LossyRequestError(f"specplugin_acceptance: expected one of {list(ACCEPTANCE_MODES)}, got {merged['mode']!r}")
    field_names = {v: k for k, v in REQUEST_KEYS.items()}

    def error(message: str):
        field, _, problem = message.partition(": ")
        return LossyRequestError(f"{field_names.get(field, field)}: {problem}")

    check_acceptance_params(merged["mode"], merged["lenience"], merged["epsilon"], merged["delta"], error)
    setting = Acceptance(**{k: (v if k == "mode" else float(v)) for k, v in merged.items()})
    if setting != server.default and not server.per_request:
        raise LossyRequestError("this server does not take per-request acceptance settings "
                                "(specplugin acceptance.per_request is false)")
    return setting


def engine_problem(vllm_config) -> str | None:
    """Why lossy acceptance cannot run on this engine, or None."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return "this engine does not use speculative decoding"
    method = getattr(spec, "rejection_sample_method", "standard")
    if method != "standard":
        return (f"rejection_sample_method is {method!r}; lossy acceptance modes patch only the 'standard' "
                "rejection sampler")
    from vllm_specplugin.config import SpecPluginConfig

    config = SpecPluginConfig.from_additional_config(getattr(vllm_config, "additional_config", None))
    if config.tree_verify == "tree":
        return "tree verification (tree_drafting.verify = tree) is exact only; lossy modes verify chains"
    return None


def check_engine(config, vllm_config) -> None:
    """At start-up: a server-wide lossy mode needs an engine it can run on; warn that it is lossy."""
    from vllm_specplugin.config import SpecPluginConfigError

    default = config.acceptance_setting().default
    if not default.lossy:
        return
    problem = engine_problem(vllm_config)
    if problem is not None:
        raise SpecPluginConfigError("acceptance.mode", f"{default.label} is not possible: {problem}")
    log_once("warning", f"specplugin: server-wide LOSSY acceptance {default.label}: speculative outputs do NOT "
                        "follow the target distribution (requests may ask for specplugin_acceptance=exact)")


# ---------------------------------------------------------------------------------------------
# The rules, in float64 torch (no vLLM): used by the patch and by the exact law in verification/lossy.py
# ---------------------------------------------------------------------------------------------


def typical_threshold(p: torch.Tensor, epsilon: float, delta: float) -> torch.Tensor:
    """min(epsilon, delta * exp(-H(p))) per row of p [..., V] (float64), H in nats, 0 log 0 = 0."""
    logp = torch.where(p > 0, p.log(), torch.zeros_like(p))
    entropy = -(p * logp).sum(-1, keepdim=True)
    return torch.clamp(delta * torch.exp(-entropy), max=epsilon)


def acceptance_probs(p: torch.Tensor, q: torch.Tensor, setting: Acceptance) -> torch.Tensor:
    """A [..., V]: probability that a drafted token y is accepted, for every y (float64).

    A draft token the verification q gives 0 is rejected, as vLLM does."""
    p, q = p.double(), q.double()
    if setting.mode == "typical":
        return (p > typical_threshold(p, setting.epsilon, setting.delta)).double() * (q > 0)
    scale = setting.lenience if setting.mode == "lenient" else 1.0
    ratio = torch.where(q > 0, p / (scale * torch.where(q > 0, q, torch.ones_like(q))), torch.zeros_like(p))
    return ratio.clamp(max=1.0)


def residual(p: torch.Tensor, q: torch.Tensor, accept: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q * A)) per row (float64); rows where it is empty fall back to p (a rejection
    there has probability 0 unless A < 1 where q = p, which the max(0, .) keeps non-empty)."""
    p = p.double()
    r = (p - q.double() * accept).clamp(min=0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / torch.where(total > 0, total, torch.ones_like(total)), p / p.sum(-1, keepdim=True))


def token_law(p: torch.Tensor, q: torch.Tensor, setting: Acceptance) -> torch.Tensor:
    """Law of the token emitted at a drafted position: q*A + (1 - sum q*A) * R (float64, row-wise)."""
    p, q = p.double(), q.double()
    accept = acceptance_probs(p, q, setting)
    accepted = q * accept
    return accepted + (1.0 - accepted.sum(-1, keepdim=True)).clamp(min=0.0) * residual(p, q, accept)


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The token whose float64 CDF interval holds u * total (never a zero-probability token)."""
    cdf = probs.double().cumsum(0)
    token = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    token = min(token, probs.shape[0] - 1)
    if probs[token] <= 0:  # rounding at the top of the CDF
        token = int(torch.nonzero(probs > 0)[-1])
    return token


def verify_row(p: torch.Tensor, q: torch.Tensor, draft: list[int], setting: Acceptance,
               uniforms: torch.Tensor, residual_u: float, bonus: int) -> tuple[list[int], int, int]:
    """One request's chain under ``setting``: (emitted tokens, accepted drafts, of them accepted only
    by the lossy rule). ``p``, ``q`` [n, V] float64 (q one-hot rows for drafts without q),
    ``uniforms`` [n] float64 in [0, 1): draft j is accepted iff uniforms[j] < A(draft j)."""
    emitted: list[int] = []
    lossy_only = 0
    for j, x in enumerate(draft):
        if x < 0:  # vLLM pads missing drafts with -1: rejected
            accept_row = None
        else:
            accept_row = acceptance_probs(p[j], q[j], setting)
            u = float(uniforms[j])
            if u < float(accept_row[x]):
                emitted.append(x)
                exact = 0.0 if q[j, x] <= 0 else min(1.0, float(p[j, x] / q[j, x]))
                lossy_only += u >= exact
                continue
        if accept_row is None:
            accept_row = torch.zeros_like(p[j])
        emitted.append(inverse_cdf(residual(p[j], q[j], accept_row), residual_u))
        return emitted, j, lossy_only
    emitted.append(bonus)
    return emitted, len(draft), lossy_only


# ---------------------------------------------------------------------------------------------
# Counters (worker) and the /metrics snapshot
# ---------------------------------------------------------------------------------------------


class LossyCounters:
    """Per mode: draft tokens verified under a lossy rule, accepted, accepted only by the lossy rule."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts: dict[str, dict[str, int]] = {}
        self.verify_steps = 0  # rows x steps verified under a lossy rule (MetricsPublisher logs when > 0)

    def add(self, mode: str, drafted: int, accepted: int, lossy_only: int) -> None:
        with self.lock:
            row = self.counts.setdefault(mode, {"drafted": 0, "accepted": 0, "lossy_only": 0})
            row["drafted"] += drafted
            row["accepted"] += accepted
            row["lossy_only"] += lossy_only
            self.verify_steps += 1

    def snapshot(self) -> dict:
        with self.lock:
            return {"lossy": {mode: dict(row) for mode, row in self.counts.items()}}

    def summary(self) -> str:
        parts = [f"{mode}: {r['accepted']}/{r['drafted']} accepted ({r['lossy_only']} only by the lossy rule)"
                 for mode, r in sorted(self.snapshot()["lossy"].items())]
        return "LOSSY acceptance " + "; ".join(parts)


_counters: LossyCounters | None = None
_publisher = None


def counters() -> LossyCounters:
    global _counters, _publisher
    if _counters is None:
        _counters = LossyCounters()
        from vllm_specplugin.metrics import MetricsPublisher

        _publisher = MetricsPublisher(_counters, "lossy", prefix="lossy")
    return _counters


# ---------------------------------------------------------------------------------------------
# The front end: validate requests at admission (HTTP 400), warn once per lossy class
# ---------------------------------------------------------------------------------------------


_server_cache: dict[int, tuple[Any, ServerAcceptance]] = {}  # id(vllm_config) -> (config, its setting)


def _server_acceptance(vllm_config) -> ServerAcceptance:
    """The engine's server-wide rule, parsed once per engine config (the front end asks per request)."""
    cached = _server_cache.get(id(vllm_config))
    if cached is None or cached[0] is not vllm_config:
        from vllm_specplugin.config import SpecPluginConfig

        config = SpecPluginConfig.from_additional_config(getattr(vllm_config, "additional_config", None))
        cached = _server_cache[id(vllm_config)] = (vllm_config, config.acceptance_setting())
    return cached[1]


def validate_request(params, vllm_config) -> Acceptance | None:
    """Check one request's ``specplugin_*`` extra arguments against this engine; warn once per lossy
    class. Raises :class:`LossyRequestError`."""
    extra = getattr(params, "extra_args", None)
    if not extra or not any(isinstance(k, str) and k.startswith("specplugin_") for k in extra):
        return None
    setting = request_setting(extra, _server_acceptance(vllm_config))
    if setting.lossy:
        problem = engine_problem(vllm_config)
        if problem is not None:
            raise LossyRequestError(f"specplugin_acceptance={setting.mode!r} is not possible here: {problem}")
        log_once("warning", f"specplugin: serving requests with LOSSY acceptance {setting.label} (asked per "
                            "request): their outputs do NOT follow the target distribution")
    return setting


def _validating_params(original):
    def _validate_params(self, params, *args, **kwargs):
        result = original(self, params, *args, **kwargs)
        try:
            validate_request(params, self.vllm_config)
        except LossyRequestError as exc:
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(f"specplugin: {exc}", parameter="vllm_xargs") from None
        return result

    return _validate_params


# ---------------------------------------------------------------------------------------------
# The worker: per-row settings around _sample, lossy rows recomputed after vLLM's rejection_sample
# ---------------------------------------------------------------------------------------------

_local = threading.local()  # .rows: list[Acceptance | None] for the step being sampled, or None


class _RunnerState:
    def __init__(self, runner):
        self.server = _server_acceptance(runner.vllm_config)
        self.problem = engine_problem(runner.vllm_config)
        # req_id -> (the live request object the rule was parsed from, its lossy rule or None).
        # Keyed on the object, not only the id: a client may reuse an id (vLLM keeps ids as given
        # with VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1), and a finished request's rule must never
        # reach the next request that carries its id.
        self.cache: dict[str, tuple[Any, Acceptance | None]] = {}
        # Lossy rows of unseeded requests draw from this generator, never from torch's global one,
        # so a lossy request cannot shift the random stream of the exact rows that follow it.
        self.generator = torch.Generator().manual_seed(0x5EC5A)


def _runner_state(runner) -> _RunnerState:
    state = getattr(runner, "_specplugin_lossy_state", None)
    if state is None:
        state = runner._specplugin_lossy_state = _RunnerState(runner)
    return state


def step_rows(runner) -> list[Acceptance | None] | None:
    """Per batch row the lossy rule of its request (None: exact); None when no row is lossy."""
    state = _runner_state(runner)
    if state.problem is not None:
        return None
    rows, any_lossy = [], False
    for req_id in runner.input_batch.req_ids:
        request = runner.requests.get(req_id)
        cached = state.cache.get(req_id)
        if cached is None or cached[0] is not request:
            extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
            try:
                setting = request_setting(extra, state.server)
            except LossyRequestError as exc:  # the front end refuses these; never fail mid-serving
                log_once("warning", f"specplugin: request {req_id} has invalid acceptance settings ({exc}); "
                                    "verifying it exactly")
                setting = state.server.default
            cached = state.cache[req_id] = (request, setting if setting.lossy else None)
        rows.append(cached[1])
        any_lossy = any_lossy or cached[1] is not None
    if len(state.cache) > len(runner.requests):  # drop finished requests (and their objects)
        state.cache = {k: v for k, v in state.cache.items() if k in runner.requests}
    return rows if any_lossy else None


def _sample_with_rows(original):
    def _sample(self, logits, spec_decode_metadata):
        if spec_decode_metadata is None:
            return original(self, logits, spec_decode_metadata)
        _local.rows = step_rows(self)
        _local.generator = _runner_state(self).generator
        try:
            return original(self, logits, spec_decode_metadata)
        finally:
            _local.rows = _local.generator = None

    return _sample


def _lossy_rejection_sample(original):
    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                         target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs):
        rows = getattr(_local, "rows", None)
        if rows is None or sampling_metadata.all_greedy or kwargs.get("synthetic_mode"):
            return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                            target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)
        output = original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                          target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)
        try:
            lossy = lossy_row_outputs(rows, num_draft_tokens, draft_token_ids, draft_probs, target_logits,
                                      bonus_token_ids, sampling_metadata, getattr(_local, "generator", None))
        except Exception:
            # Nothing was written yet (rows are computed first, written after): vLLM's exact result
            # stands for every row of this step.
            logger.exception("specplugin: lossy acceptance failed in this step; every row of it was "
                             "verified exactly")
            return output
        write_lossy_rows(output, lossy)
        return output

    return rejection_sample


def lossy_row_outputs(rows, num_draft_tokens: list[int], draft_token_ids: torch.Tensor,
                      draft_probs: torch.Tensor | None, target_logits: torch.Tensor, bonus_token_ids: torch.Tensor,
                      sampling_metadata, fallback_generator: torch.Generator | None = None) -> list[tuple]:
    """The lossy rows' results, computed without touching vLLM's output: a list of
    (row, setting, emitted token ids, drafted, accepted, lossy-only accepted). Unseeded rows draw
    from ``fallback_generator`` (the runner's own, never torch's global generator)."""
    temperature = sampling_metadata.temperature
    generators = sampling_metadata.generators
    results = []
    start = 0
    for row, (setting, n) in enumerate(zip(rows, num_draft_tokens)):
        begin, start = start, start + n
        if setting is None or n == 0 or (temperature is not None and float(temperature[row]) == 0.0):
            continue  # exact, no draft, or greedy (every mode is exact at T = 0)
        p = target_logits[begin:start].double().softmax(-1).cpu()
        draft = draft_token_ids[begin:start].tolist()
        if draft_probs is None:
            q = torch.zeros_like(p)
            for j, x in enumerate(draft):
                if x >= 0:
                    q[j, x] = 1.0
        else:
            q = draft_probs[begin:start].double().cpu()
        generator = generators.get(row)
        if generator is None:
            generator = fallback_generator
        draws = torch.rand(n + 1, dtype=torch.float64, generator=generator,
                           device=generator.device if generator is not None else "cpu").cpu()
        emitted, accepted, lossy_only = verify_row(p, q, draft, setting, draws[:n], float(draws[n]),
                                                   int(bonus_token_ids[row].reshape(-1)[0]))
        results.append((row, setting, emitted, n, accepted, lossy_only))
    return results


def write_lossy_rows(output: torch.Tensor, results: list[tuple]) -> None:
    """Write :func:`lossy_row_outputs`' rows into ``output`` [batch, max_spec_len + 1] (int32) and count them."""
    for row, setting, emitted, n, accepted, lossy_only in results:
        line = output[row]
        line.fill_(-1)
        line[: len(emitted)] = torch.tensor(emitted, dtype=line.dtype, device=line.device)
        counters().add(setting.mode, n, accepted, lossy_only)


def install() -> None:
    """Wrap the front end's request validation and the worker's sampling (vLLM 0.32.x; idempotent)."""
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_specplugin.patches import wrap_once

    wrap_once(InputProcessor, "_validate_params", _validating_params, mark=_MARK)
    wrap_once(GPUModelRunner, "_sample", _sample_with_rows, mark=_MARK)
    wrap_once(rejection_sampler, "rejection_sample", _lossy_rejection_sample, mark=_MARK)
