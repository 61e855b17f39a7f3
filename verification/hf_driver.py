"""A transformers driver for the exactness harness: samples from ``model.generate()``.

Three modes, each sampling ``n`` continuations of ``max_tokens`` tokens per prompt (batch size 1,
one ``generate`` call per sample, EOS off as the vLLM drivers' ``ignore_eos``):

* ``"plugin"``: the plugin's proposers through :mod:`vllm_specplugin.proposers.hf_generate`
  (``custom_generate=speculative_decoding``), any proposer stack ``build_proposer`` makes;
* ``"assisted"``: transformers' own assisted generation (``assistant_model=``, ``do_sample=True``)
  with the first draft checkpoint;
* ``"plain"``: ``generate(do_sample=True)`` itself.

:func:`run_hf_check` tests the samples against the exact reference
(``verification.reference.TargetReference``: the target in float32, processed in float64 with
temperature, then top-k, then top-p, which is transformers' warper order too) with the same
chain-rule test as the vLLM drivers (``verification.check.analyse`` / ``decide``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

from vllm_specplugin.verification.drivers import EngineRun, GenerationTask, SamplingConfig, TaskResult

MODES = ("plugin", "assisted", "plain")


def _generate_kwargs(sampling: SamplingConfig) -> dict:
    if sampling.temperature == 0:
        return dict(do_sample=False, max_new_tokens=sampling.max_tokens)
    # top_k = 0 turns transformers' default top-k (50) off; top_p = 1.0 is off.
    return dict(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or 0,
                top_p=sampling.top_p, max_new_tokens=sampling.max_tokens)


def load_models(target: str, drafts: Sequence[str], mode: str):
    """(target model, assistant model or None), float32, EOS off (every sample is max_tokens long)."""
    import torch
    from transformers import AutoModelForCausalLM

    def load(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # ignore_eos
        return model

    model = load(target)
    assistant = load(drafts[0]) if mode == "assisted" else None
    return model, assistant


def run_hf(
    target: str,
    tasks: Sequence[GenerationTask],
    *,
    mode: str = "plugin",
    drafts: Sequence[str] = (),
    proposer_options: dict | None = None,
    num_speculative_tokens: int = 3,
    fault: str | None = None,
    assistant_options: dict | None = None,
) -> EngineRun:
    """Sample every task with ``model.generate()`` in this process.

    Seeds: torch's global generator is seeded with ``sampling.seed + prompt index`` before a
    prompt's samples (transformers' own paths draw from it; the plugin's path too), so a run is
    reproducible on one machine. ``spec_decode_metrics`` carry the vLLM drivers' counter names
    (drafts, draft tokens, accepted tokens) for the plugin and assisted modes.
    """
    import torch

    from vllm_specplugin.proposers.hf_generate import SpeculativeStats, build_proposer, speculative_generate

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode != "plain" and not drafts:
        raise ValueError(f"mode {mode!r} needs drafts")
    t0 = time.perf_counter()
    model, assistant = load_models(target, drafts, mode)
    proposer = build_proposer(drafts, target=model, **(proposer_options or {})) if mode == "plugin" else None
    startup_s = time.perf_counter() - t0
    results = []
    for task in tasks:
        sampling = task.sampling
        kwargs = _generate_kwargs(sampling)
        stats = SpeculativeStats()
        assisted_counts = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        t1 = time.perf_counter()
        outputs = []
        for prompt_index, prompt in enumerate(task.prompts):
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed + prompt_index)
            input_ids = torch.tensor([list(prompt)])
            samples = []
            for _ in range(sampling.n):
                if mode == "plugin":
                    out = speculative_generate(model, input_ids, proposer=proposer, stats=stats, fault=fault,
                                               num_speculative_tokens=num_speculative_tokens, **kwargs)
                elif mode == "assisted":
                    out = _assisted(model, assistant, input_ids, kwargs, num_speculative_tokens,
                                    assistant_options or {}, assisted_counts)
                else:
                    out = model.generate(input_ids, **kwargs)
                samples.append(out[0, input_ids.shape[1]:].tolist())
            outputs.append(samples)
        if mode == "plugin":
            metrics = {"vllm:spec_decode_num_drafts": stats.steps_with_draft,
                       "vllm:spec_decode_num_draft_tokens": stats.drafted,
                       "vllm:spec_decode_num_accepted_tokens": stats.accepted}
        elif mode == "assisted":
            metrics = {f"vllm:spec_decode_num_{key}": value for key, value in assisted_counts.items()}
        else:
            metrics = {}
        results.append(TaskResult(outputs=outputs, generate_s=time.perf_counter() - t1, spec_decode_metrics=metrics))
    return EngineRun(startup_s=startup_s, tasks=results)


def _assisted(model, assistant, input_ids, kwargs, num_speculative_tokens, options, counts):
    """One transformers assisted generation with ``assistant`` drafting up to
    ``num_speculative_tokens`` per step (``num_assistant_tokens``; ``options``: more of the
    assistant's generation config, e.g. ``num_assistant_tokens_schedule``)."""
    assistant.generation_config.num_assistant_tokens = num_speculative_tokens
    for key, value in options.items():
        setattr(assistant.generation_config, key, value)
    with count_assisted_steps(counts):
        return model.generate(input_ids, assistant_model=assistant, **kwargs)


@contextlib.contextmanager
def count_assisted_steps(counts: dict):
    """Count transformers' speculative-sampling steps (``drafts``), candidate tokens
    (``draft_tokens``) and accepted candidates (``accepted_tokens``) while inside: wraps
    ``transformers.generation.utils._speculative_sampling`` (looked up by name at each call),
    returning exactly what it returns."""
    from transformers.generation import utils

    original = utils._speculative_sampling

    def counted(candidate_input_ids, candidate_logits, candidate_length, new_logits, *args, **kwargs):
        valid_tokens, n_matches = original(candidate_input_ids, candidate_logits, candidate_length, new_logits,
                                           *args, **kwargs)
        counts["drafts"] += 1
        counts["draft_tokens"] += int(candidate_length)
        counts["accepted_tokens"] += int(n_matches)
        return valid_tokens, n_matches

    utils._speculative_sampling = counted
    try:
        yield counts
    finally:
        utils._speculative_sampling = original


def run_hf_check(
    target: str,
    samplings: Sequence[SamplingConfig],
    prompts: Sequence[Sequence[int]],
    *,
    mode: str = "plugin",
    drafts: Sequence[str] = (),
    proposer_options: dict | None = None,
    num_speculative_tokens: int = 3,
    fault: str | None = None,
    assistant_options: dict | None = None,
    greedy_prompts: Sequence[Sequence[int]] | None = None,
    alpha: float = 0.01,
    family_size: int | None = None,
    delta: float = 0.1,
    method: str = "pearson",
    reference=None,
):
    """:func:`verification.check.run_check` with the transformers driver: sample every config with
    ``mode``, then test each against the exact reference (same decisions: Holm over the cases, or
    each case at ``alpha / family_size``). Returns a ``CheckReport`` (``driver="hf-<mode>"``)."""
    from vllm_specplugin.verification.algorithm import SAMPLING_EPS
    from vllm_specplugin.verification.check import CheckReport, _acceptance, analyse, decide
    from vllm_specplugin.verification.reference import TargetReference

    if family_size is not None and family_size < len(samplings):
        raise ValueError(f"family_size {family_size} is smaller than the {len(samplings)} cases of this report")
    case_alpha = alpha / (family_size or len(samplings))
    greedy_prompts = prompts if greedy_prompts is None else greedy_prompts
    prompts_of = [greedy_prompts if s.temperature < SAMPLING_EPS else prompts for s in samplings]
    t0 = time.perf_counter()
    run = run_hf(target, [GenerationTask([list(p) for p in ps], s) for ps, s in zip(prompts_of, samplings)],
                 mode=mode, drafts=drafts, proposer_options=proposer_options,
                 num_speculative_tokens=num_speculative_tokens, fault=fault, assistant_options=assistant_options)
    reference = reference or TargetReference(target)
    cases = [
        analyse(reference, ps, task.outputs, sampling, alpha=case_alpha, delta=delta, method=method,
                acceptance_rate=_acceptance(task.spec_decode_metrics), generate_s=task.generate_s)
        for sampling, ps, task in zip(samplings, prompts_of, run.tasks)
    ]
    cases = decide(cases, alpha, family_size)
    config = {"hf_mode": mode, "drafts": list(drafts), "num_speculative_tokens": num_speculative_tokens,
              "proposer_options": proposer_options, "assistant_options": assistant_options}
    return CheckReport(
        model=target, speculative_config=config, additional_config=None, injected_fault=fault,
        driver=f"hf-{mode}", alpha=alpha, delta=delta, method=method, cases=tuple(cases),
        startup_s=run.startup_s, wall_s=time.perf_counter() - t0, family_size=family_size or 0,
    )
