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
chain-rule test and decisions as the vLLM drivers (``verification.check.run_check`` with this driver).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
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


def run_hf_check(target: str, samplings: Sequence[SamplingConfig], prompts: Sequence[Sequence[int]], **options):
    """:func:`verification.check.run_check` with the transformers driver: sample every config with
    :func:`run_hf`, then test each against the exact reference (same decisions: Holm over the
    cases, or each case at ``alpha / family_size``). ``options``: :func:`run_hf`'s keyword
    arguments (``mode``, ``drafts``, ``fault``, ...) go to the driver, the others (``alpha``,
    ``family_size``, ``greedy_prompts``, ``reference``, ...) to ``run_check``. Returns a
    ``CheckReport`` (``driver="hf-<mode>"``, the driver's settings as its ``speculative_config``)."""
    from vllm_specplugin.verification.check import run_check

    signature = inspect.signature(run_hf)
    hf_options = {key: value for key, value in options.items() if key in signature.parameters}
    bound = signature.bind(target, [], **hf_options)
    bound.apply_defaults()
    o = bound.arguments
    config = {"hf_mode": o["mode"], "drafts": list(o["drafts"]), "num_speculative_tokens": o["num_speculative_tokens"],
              "proposer_options": o["proposer_options"], "assistant_options": o["assistant_options"]}
    check_options = {key: value for key, value in options.items() if key not in signature.parameters}
    return run_check(target, samplings, prompts, driver=functools.partial(run_hf, target, **hf_options),
                     driver_name=f"hf-{o['mode']}", speculative_config=config, injected_fault=o["fault"],
                     **check_options)
