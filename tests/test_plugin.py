"""The plugin hook: entry point, version guard, idempotence, and vLLM's internals."""

from __future__ import annotations

from importlib.metadata import entry_points

from vllm_specplugin import patches, version
from vllm_specplugin.compat import check_vllm_internals


def test_entry_point_is_registered():
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("specplugin") == "vllm_specplugin:register"


def test_register_twice_wraps_once():
    import vllm_specplugin
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    vllm_specplugin.register()
    first = (EngineArgs.create_engine_config, WorkerWrapperBase.init_device)
    vllm_specplugin.register()
    assert (EngineArgs.create_engine_config, WorkerWrapperBase.init_device) == first
    assert getattr(WorkerWrapperBase.init_device, patches._MARK)
    assert not getattr(WorkerWrapperBase.init_device.__wrapped__, patches._MARK, False)


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
