"""The plugin hook: entry point, version guard, idempotence, and vLLM's internals."""

from __future__ import annotations

import inspect
from importlib.metadata import entry_points

import pytest

from vllm_specplugin import patches, version
from vllm_specplugin.compat import check_vllm_internals


def test_entry_point_is_registered():
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("specplugin") == "vllm_specplugin:register"


def test_register_twice_wraps_once():
    import vllm_specplugin
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    vllm_specplugin.register()
    first = (EngineArgs.create_engine_config, WorkerWrapperBase.init_device, GPUModelRunner.propose_draft_token_ids)
    vllm_specplugin.register()
    assert (EngineArgs.create_engine_config, WorkerWrapperBase.init_device, GPUModelRunner.propose_draft_token_ids) == first
    for wrapped in (WorkerWrapperBase.init_device, GPUModelRunner.propose_draft_token_ids):
        assert getattr(wrapped, patches._MARK)
        assert not getattr(wrapped.__wrapped__, patches._MARK, False)


def test_version_guard():
    assert version.is_tested_version("0.32.0")
    assert version.is_tested_version("0.32.1+cpu")
    assert not version.is_tested_version("0.33.0")
    assert not version.is_tested_version("0.3.2")
    assert version.has_known_cpu_expand_bug("0.32.0+cpu")
    assert not version.has_known_cpu_expand_bug("0.32.1")


def test_installed_vllm_is_supported():
    assert version.is_tested_version(), f"vLLM {version.vllm_version()} is not the tested series"


def test_vllm_internals_have_not_moved():
    """Fails loudly when a vLLM upgrade moves anything the runtime patches rely on."""
    problems = check_vllm_internals()
    assert problems == [], "vLLM internals changed:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "owner,name,old,new,problem",
    [
        # vLLM stops copying the rows it reads: reusing one q buffer across steps would then be unsafe.
        ("runner", "_get_spec_decode_draft_probs", "torch.cat(draft_probs_rows", "torch.stack(draft_probs_rows",
         "copies the rows it reads"),
        # vLLM drafts before it samples: the q handed over at step t would be overwritten first.
        ("runner", "sample_tokens", "self._sample(", "self._sample_later(", "clears _draft_probs, then drafts"),
        ("runner", "_get_spec_decode_draft_probs", "if num_draft == 0:", "if num_draft < 0:",
         "skips rows without drafts"),
        ("batch", "add_request", "self.generators[req_index] = request.generator",
         "self.generators[req_id] = request.generator", "InputBatch.generators maps a row"),
    ],
)
def test_internals_check_notices_a_moved_internal(monkeypatch, owner, name, old, new, problem):
    """check_vllm_internals reads vLLM's source: a changed internal the shim relies on is reported."""
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    cls = {"runner": GPUModelRunner, "batch": InputBatch}[owner]
    original = inspect.unwrap(getattr(cls, name))
    source = inspect.getsource(original)
    assert old in source
    real_getsource = inspect.getsource

    def getsource(obj):
        if inspect.unwrap(obj) is original:
            return source.replace(old, new)
        return real_getsource(obj)

    monkeypatch.setattr(inspect, "getsource", getsource)
    problems = check_vllm_internals()
    assert any(problem in p for p in problems), problems
