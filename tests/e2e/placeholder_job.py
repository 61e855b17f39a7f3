"""One engine for tests/e2e/test_placeholder_drafts.py: a one-token prompt admitted beside decoding requests.

``python tests/e2e/placeholder_job.py OUT.json [SAMPLER_REPAIR]``. Six seeded T = 1 requests A
(two-token prompts) are added and prefilled in step 1; then a seeded ONE-token prompt B is added.
In step 2 vLLM's scheduler admits B beside the six decoding As and, since none of them is a
prefill chunk, pads B to 1 + k tokens with k placeholder drafts (-1) (``Scheduler.schedule``,
"Pad new decode requests to uniform spec decoding size"). Then every request runs alone with its
seed. The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the order of
steps is fixed. OUT: {"together": {id: tokens}, "alone": {id: tokens}}.
"""

from __future__ import annotations

import json
import os
import sys

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "models", "demo")
A_PROMPTS = [[85, 4], [10, 276], [7, 85], [23, 21], [16, 372], [65, 494]]
B_PROMPT = [85]


def main(out_path: str, sampler_repair: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=os.path.join(DEMO, "target"), dtype="float32", max_model_len=256, gpu_memory_utilization=0.3,
              seed=0, enforce_eager=True, enable_prefix_caching=False, max_num_seqs=16,
              speculative_config={"method": "custom_class", "model": "vllm_specplugin.adapters.MultiDraftProposer",
                                  "num_speculative_tokens": 3},
              additional_config={"specplugin": {"drafts": [os.path.join(DEMO, "draft-distill")],
                                                "cpu_sampler_repair": sampler_repair}})
    engine = llm.llm_engine

    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=seed)

    def drain(outputs: dict) -> None:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)

    together: dict = {}
    for i, prompt in enumerate(A_PROMPTS):
        engine.add_request(f"A{i}", TokensPrompt(prompt_token_ids=prompt), params(1000 + i))
    engine.step()  # step 1: the As prefill alone
    engine.add_request("B", TokensPrompt(prompt_token_ids=B_PROMPT), params(2000))
    drain(together)
    alone: dict = {}
    for i, prompt in enumerate(A_PROMPTS):
        engine.add_request(f"A{i}", TokensPrompt(prompt_token_ids=prompt), params(1000 + i))
        drain(alone)
    engine.add_request("B", TokensPrompt(prompt_token_ids=B_PROMPT), params(2000))
    drain(alone)
    with open(out_path, "w") as f:
        json.dump({"together": together, "alone": alone}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "auto")
