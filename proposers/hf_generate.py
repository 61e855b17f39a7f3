"""The plugin's proposers inside Hugging Face transformers' ``model.generate()``.

Three equivalent ways in (transformers 5.x; batch size 1, decoder-only models, as transformers'
own assisted generation):

1. ``model.generate(input_ids, custom_generate=speculative_decoding, proposer=..., do_sample=True,
   temperature=..., top_k=..., top_p=..., max_new_tokens=...)``: transformers 5 accepts a callable
   as ``custom_generate``; ``generate`` prepares the generation config, the logits processors
   (temperature, top-k, top-p, repetition penalty, ...) and the stopping criteria as usual, then
   hands the decoding loop to :func:`speculative_decoding`. Arguments that ``_sample`` does not
   take (``proposer``, ``num_speculative_tokens``, ``spec_generator``, ``spec_stats``, ``drafts``,
   ``spec_options``) are passed to it.
2. :func:`speculative_generate` ``(model, input_ids, proposer=..., ...)``: the same call, spelled
   as a function.
3. ``model.generate(input_ids, custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True,
   drafts=[...], ...)``: a local directory with ``custom_generate/generate.py`` (the form
   transformers loads from the Hub), which calls (1).

What drafts: any :class:`~vllm_specplugin.proposers.base.Proposer` of this package;
:func:`build_proposer` builds the plugin's stack from draft checkpoints, as the vLLM adapter
does: :class:`DraftRuntime` per draft (per-request KV caches, lean Llama forward), the
:class:`EnsembleProposer` (1-3 drafts, optional adaptive weights), optional
:class:`TreeProposer` (tree drafting, **chain verification of the tree's best path**: the path is
a deterministic function of the draft's distributions, so its q is one-hot) and optional
:class:`AdaptiveGamma` on top.

How it verifies (exact at any temperature, with top-k / top-p): per step the proposer drafts up
to γ tokens after the context; the target runs once over the uncached tokens and the drafts
(``DynamicCache``, cropped back after the step); each of the γ + 1 logit rows is processed by
transformers' own ``logits_processor`` with the input ids it would see when sampling token by
token (as transformers' assisted generation does), so the target distribution p is exactly what
``generate(do_sample=True)`` samples from; p = softmax of the processed scores in float64. The
chain is then walked by :func:`~vllm_specplugin.proposers.tree_verify.verify_tree_nodes` on a
one-path tree with the ``iid`` rule (accept x with min(1, p(x) / q(x)), else draw from
norm(max(p - q, 0))): the project's single implementation of the acceptance rule, the one vLLM's
tree verification walks too. q is the draft's ``Draft.probs``, the distribution each token was
actually drawn from (one-hot rows for deterministic choices, where the rule reduces to the
one-hot rule). Greedy (``do_sample=False``): the target is the one-hot at the argmax of the
processed scores. Uniforms and draws are float64 inverse-CDF (``proposers/sampling.py``).

Stopping: ``max_length`` / ``max_new_tokens`` and EOS truncate a step's emitted tokens (a prefix
of an exact stream is exact); other stopping criteria are checked after each step, as
transformers' assisted generation does.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vllm_specplugin.proposers.base import DraftRequest, Proposer
from vllm_specplugin.proposers.sampling import SamplingParams
from vllm_specplugin.proposers.tree_verify import AcceptanceRule, verify_tree_nodes

# ``model.generate(custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True, ...)``
CUSTOM_GENERATE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_custom_generate")
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
# Wrong variants for tests that must see the exactness check fail (mapped onto tree_verify's
# FAULTS, or acting on the target's processing here).
FAULTS = ("residual_not_updated", "unprocessed_target")


@dataclass
class SpeculativeStats:
    """Totals over :func:`speculative_decoding` calls that share this object (``spec_stats=``)."""

    steps: int = 0  # target forwards (verification steps)
    steps_with_draft: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    draft_time_s: float = 0.0  # proposer.propose()
    target_time_s: float = 0.0  # target forward, processing and the acceptance walk
    gamma_counts: dict[int, int] = field(default_factory=dict)
    accepted_per_position: list[int] = field(default_factory=list)  # accepted at draft position i

    @property
    def alpha(self) -> float | None:
        """Accepted over drafted tokens."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per step with a draft: accepted drafts + the target's own."""
        return 1 + self.accepted / self.steps_with_draft if self.steps_with_draft else 1.0


def build_proposer(
    drafts: Sequence[str],
    *,
    target=None,
    weights: Sequence[float] | None = None,
    adapt_weights: bool = False,
    adaptive_gamma=None,
    tree_drafting=None,
    dtype: str = "float32",
    device: str = "cpu",
    memory_budget_mb: float = 512,
    prefix_sharing: bool = False,
) -> Proposer:
    """The plugin's proposer stack over 1-3 draft checkpoints (as the vLLM adapter composes it):
    DraftRuntime per draft -> EnsembleProposer -> TreeProposer (``tree_drafting``: a dict of its
    parameters, or True) -> AdaptiveGamma (``adaptive_gamma``: a GammaPolicy, a dict of its
    fields, or True). ``target``: the target model (or its path), whose vocabulary the drafts
    must share (a draft vocabulary that is a prefix of the target's is padded, as in vLLM)."""
    from vllm_specplugin.proposers.draft_runtime import DraftRuntime
    from vllm_specplugin.proposers.ensemble import EnsembleProposer
    from vllm_specplugin.proposers.gamma import AdaptiveGamma, GammaPolicy
    from vllm_specplugin.proposers.tree import TreeProposer

    target_vocab_size, target_path = None, None
    if isinstance(target, str):
        from transformers import AutoConfig

        target_vocab_size, target_path = AutoConfig.from_pretrained(target).vocab_size, target
    elif target is not None:
        target_vocab_size = int(target.config.vocab_size)
        name = getattr(target, "name_or_path", None) or getattr(target.config, "_name_or_path", None)
        target_path = name if name and os.path.isdir(name) else None
    runtimes = [
        DraftRuntime(path, target_vocab_size=target_vocab_size, target_path=target_path, dtype=dtype,
                     device=device, memory_budget_mb=memory_budget_mb, prefix_sharing=prefix_sharing)
        for path in drafts
    ]
    proposer: Proposer = EnsembleProposer(runtimes, weights, adapt_weights=adapt_weights)
    if tree_drafting:
        options = {} if tree_drafting is True else dict(tree_drafting)
        if options.get("verify", "chain") != "chain":
            raise ValueError("transformers' generate() verifies chains: tree_drafting.verify must be 'chain'")
        proposer = TreeProposer(proposer, **options)
    if adaptive_gamma:
        if isinstance(adaptive_gamma, GammaPolicy):
            policy = adaptive_gamma
        else:
            policy = GammaPolicy(**({} if adaptive_gamma is True else dict(adaptive_gamma)))
        proposer = AdaptiveGamma(proposer, policy)
    return proposer


def _draft_params(generation_config) -> SamplingParams:
    """What the draft samples with: the request's temperature, top-k and top-p (greedy when not
    sampling). Any q is exact, since verification uses the q drafted from; matching the target's
    processing only raises acceptance."""
    if not generation_config.do_sample:
        return SamplingParams(temperature=0.0)
    temperature = generation_config.temperature
    top_k = generation_config.top_k
    top_p = generation_config.top_p
    return SamplingParams(
        temperature=1.0 if temperature is None else float(temperature),
        top_k=0 if top_k is None else int(top_k),
        top_p=1.0 if top_p is None else float(top_p),
    )


def _new_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older signature
        return DynamicCache()


def processed_target_scores(logits_processor, input_ids: torch.Tensor, logits: torch.Tensor,
                            fault: str | None = None) -> torch.Tensor:
    """Row i of ``logits`` [R, V] processed by ``logits_processor`` with the input ids it would
    see when sampling token by token: ``input_ids[:, :n - R + 1 + i]`` (``input_ids`` [1, n] ends
    with the R - 1 drafted tokens). Float32, as transformers' ``_sample`` processes them."""
    rows = logits.shape[0]
    base = input_ids.shape[1] - rows + 1
    scores = logits.float().clone()
    if fault == "unprocessed_target" or logits_processor is None:
        return scores
    for i in range(rows):
        scores[i:i + 1] = logits_processor(input_ids[:, :base + i], scores[i:i + 1].clone())
    return scores


@torch.no_grad()
def speculative_decoding(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    synced_gpus: bool = False,
    streamer=None,
    proposer: Proposer | None = None,
    num_speculative_tokens: int | None = None,
    spec_generator: torch.Generator | None = None,
    spec_stats: SpeculativeStats | None = None,
    spec_fault: str | None = None,
    drafts: Sequence[str] | None = None,
    spec_options: dict | None = None,
    **model_kwargs,
):
    """The decoding loop for ``model.generate(custom_generate=speculative_decoding, ...)``.

    ``proposer``: any Proposer (or ``drafts``: draft checkpoint paths, built with
    :func:`build_proposer` and ``spec_options``). ``num_speculative_tokens``: γ, the most tokens
    drafted per step (default 4; adaptive γ picks within it). ``spec_generator``: a
    torch.Generator for the drafts and the acceptance walk (default: torch's global one, so
    ``torch.manual_seed`` fixes a run). ``spec_stats``: a :class:`SpeculativeStats` to add to.
    ``spec_fault``: one of :data:`FAULTS` (tests only).
    """
    from transformers import GenerationConfig

    if model.config.is_encoder_decoder:
        raise ValueError("speculative_decoding supports decoder-only models")
    if input_ids.shape[0] != 1:
        raise ValueError(f"speculative_decoding supports batch size 1 (as assisted generation), got {input_ids.shape[0]}")
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is not None and not bool((attention_mask == 1).all()):
        raise ValueError("speculative_decoding does not support padded inputs")
    if spec_fault is not None and spec_fault not in FAULTS:
        raise ValueError(f"unknown fault {spec_fault!r}; known: {FAULTS}")
    generation_config = generation_config or GenerationConfig()
    if getattr(generation_config, "num_beams", 1) not in (None, 1):
        raise ValueError("speculative_decoding does not do beam search")
    owned = proposer is None
    if owned:
        if not drafts:
            raise ValueError("give proposer= (a Proposer) or drafts= (draft checkpoint paths)")
        proposer = build_proposer(drafts, target=model, **(spec_options or {}))
    gamma_max = DEFAULT_NUM_SPECULATIVE_TOKENS if num_speculative_tokens is None else int(num_speculative_tokens)
    if gamma_max < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {gamma_max}")
    stats = spec_stats if spec_stats is not None else SpeculativeStats()
    params = _draft_params(generation_config)
    greedy = not generation_config.do_sample
    eos = generation_config._eos_token_tensor if hasattr(generation_config, "_eos_token_tensor") else None
    if eos is None and generation_config.eos_token_id is not None:
        eos = torch.tensor(generation_config.eos_token_id).reshape(-1)
    eos_ids = set() if eos is None else {int(t) for t in eos.reshape(-1).tolist()}
    max_length = generation_config.max_length
    vocab = int(model.get_output_embeddings().weight.shape[0]) if model.get_output_embeddings() is not None \
        else int(model.config.vocab_size)
    device = input_ids.device

    context = [int(t) for t in input_ids[0].tolist()]
    cache = _new_cache(model)
    cached = 0  # context tokens whose K/V the target cache holds
    request_id = f"hf-generate-{uuid.uuid4().hex}"
    walk_fault = "residual_not_updated" if spec_fault == "residual_not_updated" else None
    try:
        while True:
            budget = (max_length - len(context)) if max_length is not None else None
            if budget is not None and budget <= 0:
                break
            gamma = gamma_max if budget is None else min(gamma_max, budget - 1)
            started = time.perf_counter()
            draft = proposer.propose([DraftRequest(request_id, context, gamma, params, spec_generator)])[0]
            stats.draft_time_s += time.perf_counter() - started
            tokens = [int(t) for t in draft.token_ids[:gamma]]
            if draft.parents is not None:
                raise ValueError("speculative_decoding verifies chains; the proposer returned a tree")
            started = time.perf_counter()
            fresh = context[cached:] + tokens
            out = model(
                input_ids=torch.tensor([fresh], device=device),
                position_ids=torch.arange(cached, cached + len(fresh), device=device)[None],
                past_key_values=cache,
                use_cache=True,
                return_dict=True,
            )
            logits = out.logits[0, -(len(tokens) + 1):]
            full = torch.tensor([context + tokens], device=device)
            scores = processed_target_scores(logits_processor, full, logits, spec_fault)
            target = torch.softmax(scores.double(), dim=-1)
            # q per node of the one-path tree: row j is what token j + 1 was drawn from; the leaf's
            # row is never read (a draft vocabulary that is a prefix of the target's is padded).
            # The draft draws from q / sum(q) in float64 (proposers/sampling.py), so that is the q
            # verified: a float32 row over thousands of tokens sums to 1 only within ~1e-6.
            draft_probs = torch.zeros(len(tokens) + 1, vocab, dtype=torch.float64)
            if tokens:
                q = draft.probs[: len(tokens)].detach().to("cpu", torch.float64)
                draft_probs[: len(tokens), : q.shape[-1]] = q / q.sum(-1, keepdim=True)
            accepted, emitted = verify_tree_nodes(
                target, draft_probs, list(range(-1, len(tokens))), [-1] + tokens, AcceptanceRule.IID,
                spec_generator, greedy=greedy, fault=walk_fault,
            )
            stats.target_time_s += time.perf_counter() - started
            stats.steps += 1
            stats.gamma_counts[len(tokens)] = stats.gamma_counts.get(len(tokens), 0) + 1
            if tokens:
                stats.steps_with_draft += 1
                stats.drafted += len(tokens)
                stats.accepted += len(accepted)
                while len(stats.accepted_per_position) < len(tokens):
                    stats.accepted_per_position.append(0)
                for i in range(len(accepted)):
                    stats.accepted_per_position[i] += 1
            # Keep the K/V of the context and the accepted drafts; the last emitted token is new.
            cached = len(context) + len(accepted)
            stale = cache.get_seq_length() - cached
            if stale > 0:
                cache.crop(-stale)  # a negative count removes that many entries from the end
            if budget is not None:
                emitted = emitted[:budget]  # never shorter: gamma <= budget - 1
            stop_at_eos = next((i for i, t in enumerate(emitted) if t in eos_ids), None)
            if stop_at_eos is not None:
                emitted = emitted[: stop_at_eos + 1]
            context.extend(emitted)
            stats.emitted += len(emitted)
            if streamer is not None:
                streamer.put(torch.tensor(emitted))
            if stop_at_eos is not None:
                break
            if stopping_criteria is not None and len(stopping_criteria) > 0:
                ids = torch.tensor([context], device=device)
                if bool(stopping_criteria(ids, None).any()):
                    break
    finally:
        proposer.free(request_id)
    if streamer is not None:
        streamer.end()
    sequences = torch.tensor([context], dtype=torch.long, device=device)
    if getattr(generation_config, "return_dict_in_generate", False):
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def speculative_generate(
    model,
    input_ids: torch.LongTensor,
    *,
    proposer: Proposer,
    num_speculative_tokens: int | None = None,
    generator: torch.Generator | None = None,
    stats: SpeculativeStats | None = None,
    fault: str | None = None,
    **generate_kwargs,
):
    """``model.generate(input_ids, custom_generate=speculative_decoding, ...)``: any generate
    argument (``generation_config``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
    ``max_new_tokens``, ``logits_processor``, ...) is passed on; returns what generate returns."""
    return model.generate(
        input_ids, custom_generate=speculative_decoding, proposer=proposer,
        num_speculative_tokens=num_speculative_tokens, spec_generator=generator, spec_stats=stats,
        spec_fault=fault, **generate_kwargs,
    )
