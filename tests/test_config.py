"""The plugin's config schema: valid configs parse, malformed ones fail naming the field."""

from __future__ import annotations

import pytest

from vllm_specplugin.config import SpecPluginConfig, SpecPluginConfigError


@pytest.fixture
def draft_dirs(tmp_path):
    dirs = []
    for name in ("a", "b", "c", "d"):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text("{}")
        dirs.append(str(d))
    return dirs


def test_defaults_when_absent():
    assert SpecPluginConfig.from_additional_config({}) == SpecPluginConfig()
    assert SpecPluginConfig.from_additional_config(None) == SpecPluginConfig()
    assert SpecPluginConfig.from_additional_config({"other_plugin": {"x": 1}}) == SpecPluginConfig()


def test_valid_config(draft_dirs):
    config = SpecPluginConfig.from_additional_config(
        {
            "specplugin": {
                "cpu_sampler_repair": "off",
                "drafts": draft_dirs[:2],
                "draft_weights": [1, 3],
                "draft_dtype": "bfloat16",
                "draft_memory_budget_mb": 64,
                "adapt_draft_weights": True,
                "runner_shim": False,
            }
        }
    )
    assert config.cpu_sampler_repair == "off"
    assert config.drafts == tuple(draft_dirs[:2])
    assert config.draft_weights == (1.0, 3.0)
    assert config.draft_memory_budget_mb == 64
    assert config.adapt_draft_weights and not config.runner_shim
    assert config.gamma_policy() is None


def test_adaptive_gamma_config():
    config = SpecPluginConfig.from_dict({"adaptive_gamma": {"mode": "cost_model", "gamma_min": 0, "max_batch": 8}})
    policy = config.gamma_policy()
    assert (policy.mode, policy.gamma_min, policy.max_batch, policy.raise_above) == ("cost_model", 0, 8, 0.8)
    assert SpecPluginConfig.from_dict({"adaptive_gamma": True}).gamma_policy().mode == "threshold"


def test_adaptive_gamma_probe_and_initial_alpha_keys():
    defaults = SpecPluginConfig.from_dict({"adaptive_gamma": True}).gamma_policy()
    assert (defaults.probe_every, defaults.initial_alpha) == (8, 0.7)
    policy = SpecPluginConfig.from_dict(
        {"adaptive_gamma": {"gamma_min": 0, "probe_every": 3, "initial_alpha": 1}}
    ).gamma_policy()
    assert (policy.gamma_min, policy.probe_every, policy.initial_alpha) == (0, 3, 1.0)
    assert isinstance(policy.initial_alpha, float)
    assert defaults.population_weight == 0.05
    weighted = SpecPluginConfig.from_dict({"adaptive_gamma": {"population_weight": 0.2}}).gamma_policy()
    assert weighted.population_weight == 0.2


def test_suffix_drafting_config():
    assert SpecPluginConfig.from_dict({}).drafter_choice() is None
    settings, policy = SpecPluginConfig.from_dict({"suffix_drafting": True}).drafter_choice()
    assert settings.min_match == 2 and policy.draft_cost == 0.12
    settings, policy = SpecPluginConfig.from_dict(
        {"suffix_drafting": {"min_match": 3, "corpus_requests": 0, "draft_cost": 0.3, "probe_every": 4}}
    ).drafter_choice()
    assert (settings.min_match, settings.corpus_requests, policy.draft_cost, policy.probe_every) == (3, 0, 0.3, 4)
    assert policy.measure_costs is True
    assert SpecPluginConfig.from_dict({"suffix_drafting": {"measure_costs": False}}).drafter_choice()[1].measure_costs is False
    assert policy.model_run_prior == 0.8
    assert SpecPluginConfig.from_dict({"suffix_drafting": {"model_run_prior": 0.6}}).drafter_choice()[1].model_run_prior == 0.6


def test_json_string_is_accepted():
    config = SpecPluginConfig.from_additional_config('{"specplugin": {"cpu_sampler_repair": "on"}}')
    assert config.cpu_sampler_repair == "on"


MALFORMED = [
    ("unknown key", {"specplugin": {"gamma_typo": 3}}, "gamma_typo"),
    ("section not an object", {"specplugin": [1, 2]}, "specplugin"),
    ("repair mode wrong type", {"specplugin": {"cpu_sampler_repair": True}}, "cpu_sampler_repair"),
    ("repair mode unknown", {"specplugin": {"cpu_sampler_repair": "maybe"}}, "cpu_sampler_repair"),
    ("drafts not a list", {"specplugin": {"drafts": 5}}, "drafts"),
    ("drafts empty", {"specplugin": {"drafts": []}}, "drafts"),
    ("draft path missing", {"specplugin": {"drafts": ["/nonexistent/draft"]}}, "drafts"),
    ("negative weight", {"specplugin": {"draft_weights": [-1.0]}}, "draft_weights"),
    ("all-zero weights", {"specplugin": {"draft_weights": [0, 0]}}, "draft_weights"),
    ("weight not a number", {"specplugin": {"draft_weights": ["1"]}}, "draft_weights"),
    ("nan weight", {"specplugin": {"draft_weights": [float("nan")]}}, "draft_weights"),
    ("dtype unknown", {"specplugin": {"draft_dtype": "int8"}}, "draft_dtype"),
    ("budget zero", {"specplugin": {"draft_memory_budget_mb": 0}}, "draft_memory_budget_mb"),
    ("budget float", {"specplugin": {"draft_memory_budget_mb": 1.5}}, "draft_memory_budget_mb"),
    ("budget bool", {"specplugin": {"draft_memory_budget_mb": True}}, "draft_memory_budget_mb"),
    ("shim flag not a bool", {"specplugin": {"runner_shim": "yes"}}, "runner_shim"),
    ("adapt flag not a bool", {"specplugin": {"adapt_draft_weights": 1}}, "adapt_draft_weights"),
    ("adapted weights with trees (trees do not score the drafts)",
     {"specplugin": {"tree_drafting": True, "adapt_draft_weights": True}}, "adapt_draft_weights"),
    ("adaptive gamma not an object", {"specplugin": {"adaptive_gamma": 3}}, "adaptive_gamma"),
    ("adaptive gamma unknown key", {"specplugin": {"adaptive_gamma": {"gama_max": 3}}}, "adaptive_gamma.gama_max"),
    ("adaptive gamma bad mode", {"specplugin": {"adaptive_gamma": {"mode": "fast"}}}, "adaptive_gamma"),
    ("adaptive gamma thresholds crossed",
     {"specplugin": {"adaptive_gamma": {"raise_above": 0.5, "lower_below": 0.7}}}, "adaptive_gamma"),
    ("adaptive gamma negative min", {"specplugin": {"adaptive_gamma": {"gamma_min": -1}}}, "adaptive_gamma"),
    ("adaptive gamma max_batch 0", {"specplugin": {"adaptive_gamma": {"max_batch": 0}}}, "adaptive_gamma.max_batch"),
    ("adaptive gamma ema string", {"specplugin": {"adaptive_gamma": {"ema_weight": "0.3"}}}, "adaptive_gamma.ema_weight"),
    ("adaptive gamma population_weight 0",
     {"specplugin": {"adaptive_gamma": {"population_weight": 0}}}, "adaptive_gamma.population_weight"),
    ("adaptive gamma probe_every 0",
     {"specplugin": {"adaptive_gamma": {"probe_every": 0}}}, "adaptive_gamma.probe_every"),
    ("adaptive gamma probe_every float",
     {"specplugin": {"adaptive_gamma": {"probe_every": 2.5}}}, "adaptive_gamma.probe_every"),
    ("adaptive gamma probe_every bool",
     {"specplugin": {"adaptive_gamma": {"probe_every": True}}}, "adaptive_gamma.probe_every"),
    ("adaptive gamma initial_alpha above 1",
     {"specplugin": {"adaptive_gamma": {"initial_alpha": 1.2}}}, "adaptive_gamma.initial_alpha"),
    ("adaptive gamma initial_alpha negative",
     {"specplugin": {"adaptive_gamma": {"initial_alpha": -0.1}}}, "adaptive_gamma.initial_alpha"),
    ("adaptive gamma initial_alpha nan",
     {"specplugin": {"adaptive_gamma": {"initial_alpha": float("nan")}}}, "adaptive_gamma.initial_alpha"),
    ("prefix sharing not a bool", {"specplugin": {"prefix_sharing": "on"}}, "prefix_sharing"),
    ("prefix block size zero", {"specplugin": {"prefix_block_size": 0}}, "prefix_block_size"),
    ("tree not an object", {"specplugin": {"tree_drafting": "big"}}, "tree_drafting"),
    ("tree unknown key", {"specplugin": {"tree_drafting": {"depth": 3}}}, "tree_drafting.depth"),
    ("tree zero budget", {"specplugin": {"tree_drafting": {"node_budget": 0}}}, "tree_drafting.node_budget"),
    ("tree shape unknown", {"specplugin": {"tree_drafting": {"shape": "wide"}}}, "tree_drafting.shape"),
    ("tree alpha without the dynamic shape", {"specplugin": {"tree_drafting": {"alpha": [0.8]}}}, "tree_drafting.alpha"),
    ("tree alpha above one", {"specplugin": {"tree_drafting": {"shape": "dynamic", "alpha": [1.2]}}},
     "tree_drafting.alpha"),
    ("tree alpha empty", {"specplugin": {"tree_drafting": {"shape": "dynamic", "alpha": []}}}, "tree_drafting.alpha"),
    ("tree confidence not a list", {"specplugin": {"tree_drafting": {"shape": "dynamic", "confidence": 0.5}}},
     "tree_drafting.confidence"),
    ("tree calibration weight negative",
     {"specplugin": {"tree_drafting": {"shape": "dynamic", "calibration_weight": -1}}}, "tree_drafting.calibration_weight"),
    ("tree branch cost negative",
     {"specplugin": {"tree_drafting": {"shape": "dynamic", "branch_cost": -0.1}}}, "tree_drafting.branch_cost"),
    ("tree branch cost a bool", {"specplugin": {"tree_drafting": {"shape": "dynamic", "branch_cost": True}}},
     "tree_drafting.branch_cost"),
    ("tree branch cost without the dynamic shape", {"specplugin": {"tree_drafting": {"branch_cost": 0.2}}},
     "tree_drafting.branch_cost"),
    ("suffix drafting not an object", {"specplugin": {"suffix_drafting": 3}}, "suffix_drafting"),
    ("suffix drafting unknown key", {"specplugin": {"suffix_drafting": {"depth": 3}}}, "suffix_drafting.depth"),
    ("suffix drafting float match", {"specplugin": {"suffix_drafting": {"min_match": 1.5}}}, "suffix_drafting.min_match"),
    ("suffix drafting cost string", {"specplugin": {"suffix_drafting": {"draft_cost": "0.1"}}},
     "suffix_drafting.draft_cost"),
    ("suffix drafting matches crossed", {"specplugin": {"suffix_drafting": {"min_match": 5, "max_match": 3}}},
     "suffix_drafting"),
    ("suffix drafting measure_costs not a bool", {"specplugin": {"suffix_drafting": {"measure_costs": 1}}},
     "suffix_drafting.measure_costs"),
    ("suffix drafting prior above one", {"specplugin": {"suffix_drafting": {"suffix_prior": 1.5}}}, "suffix_drafting"),
    ("suffix drafting run prior above one", {"specplugin": {"suffix_drafting": {"model_run_prior": 1.2}}},
     "suffix_drafting"),
    ("suffix drafting with adaptive gamma", {"specplugin": {"suffix_drafting": True, "adaptive_gamma": True}},
     "suffix_drafting"),
    ("suffix drafting with the suffix merged into the tree",
     {"specplugin": {"suffix_drafting": {}, "tree_drafting": {"verify": "tree", "merge": ["suffix"]}}}, "suffix_drafting"),
    ("draft fast path not a bool", {"specplugin": {"draft_fast_path": "yes"}}, "draft_fast_path"),
    ("draft-free sampler unknown", {"specplugin": {"draft_free_sampler": "fast"}}, "draft_free_sampler"),
    ("invalid JSON string", "{specplugin: ", "additional_config"),
]


@pytest.mark.parametrize("case,raw,field", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_config_names_the_field(case, raw, field):
    with pytest.raises(SpecPluginConfigError) as info:
        SpecPluginConfig.from_additional_config(raw)
    assert info.value.field == field
    assert f"'{field}'" in str(info.value)
    if "unknown" not in case:  # a known key with a bad value is not reported as an unknown key
        assert "unknown key" not in str(info.value)


def test_too_many_drafts(draft_dirs):
    with pytest.raises(SpecPluginConfigError, match="'drafts'.*1 to 3"):
        SpecPluginConfig.from_dict({"drafts": draft_dirs})


def test_weights_must_match_drafts(draft_dirs):
    with pytest.raises(SpecPluginConfigError, match="'draft_weights'.*3 entries.*'drafts' has 2"):
        SpecPluginConfig.from_dict({"drafts": draft_dirs[:2], "draft_weights": [1, 1, 1]})


def test_engine_start_up_rejects_malformed_config(random_target):
    """The plugin hook validates while vLLM builds its config: before any model loads."""
    import vllm_specplugin
    from vllm.engine.arg_utils import EngineArgs

    vllm_specplugin.register()
    args = EngineArgs(
        model=random_target,
        dtype="float32",
        max_model_len=256,
        additional_config={"specplugin": {"cpu_sampler_repair": "sometimes"}},
    )
    with pytest.raises(SpecPluginConfigError, match="'cpu_sampler_repair'"):
        args.create_engine_config()


def test_dynamic_tree_shape_keys_reach_the_tree_proposer():
    """The shape keys are accepted as given and are TreeProposer's own arguments (the adapter
    passes tree_drafting as keyword arguments), and the config's shape names are the proposer's."""
    import inspect

    from vllm_specplugin.config import TREE_SHAPES
    from vllm_specplugin.proposers.tree import TREE_SHAPES as PROPOSER_SHAPES
    from vllm_specplugin.proposers.tree import TreeProposer

    raw = {"tree_drafting": {"shape": "dynamic", "alpha": [0.9, 0.7], "confidence": [0.8, 0.6],
                             "calibration_weight": 2, "branch_cost": 0, "verify": "tree", "node_budget": 8}}
    tree = SpecPluginConfig.from_dict(raw).tree_drafting
    assert tree == {"shape": "dynamic", "alpha": [0.9, 0.7], "confidence": [0.8, 0.6],
                    "calibration_weight": 2.0, "branch_cost": 0.0, "verify": "tree", "node_budget": 8}
    assert set(tree) <= set(inspect.signature(TreeProposer).parameters)
    assert TREE_SHAPES == PROPOSER_SHAPES


def test_heads_drafters_combine_with_the_drafter_choice_only(tmp_path):
    """eagle_head / medusa_heads with suffix_drafting (the head's chain chosen against the suffix
    drafter's per request) is a config; with draft models, adaptive γ or each other it is an error
    naming the field."""
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    for key in ("eagle_head", "medusa_heads"):
        config = SpecPluginConfig.from_dict({key: str(head), "suffix_drafting": {"model_gamma": 3}})
        settings, policy = config.drafter_choice()
        assert getattr(config, key) == str(head) and policy.model_gamma == 3
        for other in ({"adaptive_gamma": {}}, {"drafts": [str(head)]}, {"draft_weights": [1.0]}):
            with pytest.raises(SpecPluginConfigError) as info:
                SpecPluginConfig.from_dict({key: str(head), **other})
            assert info.value.field == key, info.value


def test_the_drafter_choice_combines_with_tree_drafting(tmp_path):
    """suffix_drafting with tree_drafting (the model's tree, the suffix chain or nothing per request
    and step) is a config, for heads drafters too, and with zero-cost drafters merged into the tree
    other than the suffix drafter; merging the suffix drafter into the tree as well is an error."""
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    tree = {"node_budget": 8, "verify": "tree", "shape": "dynamic"}
    for drafter in ({"drafts": [str(head)]}, {"eagle_head": str(head)}, {"medusa_heads": str(head)}):
        config = SpecPluginConfig.from_dict({**drafter, "suffix_drafting": {}, "tree_drafting": tree})
        assert config.drafter_choice() is not None and config.tree_verify == "tree"
    config = SpecPluginConfig.from_dict({"drafts": [str(head)], "suffix_drafting": {},
                                         "tree_drafting": {**tree, "merge": ["ngram"]}})
    assert config.tree_proposer_settings()[1] == ["ngram"]
    with pytest.raises(SpecPluginConfigError) as info:
        SpecPluginConfig.from_dict({"drafts": [str(head)], "suffix_drafting": {},
                                    "tree_drafting": {**tree, "merge": ["ngram", "suffix"]}})
    assert info.value.field == "suffix_drafting" and "merge" in str(info.value)


def test_draft_routing(draft_dirs):
    config = SpecPluginConfig.from_dict({"drafts": draft_dirs[:2], "draft_routing": "prompt"})
    assert config.draft_routing == "prompt"
    assert SpecPluginConfig.from_dict({"drafts": draft_dirs[:2]}).draft_routing is None
    for raw, message in [
        ({"drafts": draft_dirs[:1], "draft_routing": "prompt"}, "give 2 or 3 drafts"),
        ({"drafts": draft_dirs[:2], "draft_routing": "prompt", "draft_weights": [1, 2]}, "draft_weights"),
        ({"drafts": draft_dirs[:2], "draft_routing": "prompt", "adapt_draft_weights": True}, "adapt_draft_weights"),
        ({"drafts": draft_dirs[:2], "draft_routing": "best"}, "expected one of"),
        ({"drafts": draft_dirs[:2], "draft_routing": True}, "expected one of"),
    ]:
        with pytest.raises(SpecPluginConfigError, match=message) as info:
            SpecPluginConfig.from_dict(raw)
        assert info.value.field == "draft_routing"
