"""Every change the plugin makes to vLLM at run time, installed in one place, each behind a version check.

vLLM runs general plugins in every process, sometimes twice, so :func:`install` is idempotent:
each wrapper marks itself and is never stacked (``patches.wrap_once``).

Top layer of the package (tests/test_layout.py holds the order): this module imports the pieces
(``runner_shim``, ``tree_verification``, ``draft_free_steps``, ``lossy_acceptance``, the
repairs, ...) and the test-only faults; none of them imports it back.
"""

from __future__ import annotations

from vllm_specplugin import version
from vllm_specplugin.config import SpecPluginConfig
from vllm_specplugin.logging_utils import log_once
from vllm_specplugin.patches import wrap_once


def install() -> None:
    _wrap_engine_config_validation()
    from vllm_specplugin import faults

    fault = faults.requested_fault()
    if fault is not None:
        faults.install(fault)
    faults.install_draft_faults()  # SPECPLUGIN_DRAFT_FAULT (robustness tests); a no-op unless set
    if not version.is_tested_version():
        log_once(
            "warning",
            f"vllm-specplugin was tested with vLLM {', '.join(version.TESTED_VLLM_SERIES)}.x; found "
            f"{version.vllm_version()}. Runtime patches (CPU sampler repair, runner shim) are NOT installed. "
            "Proposers still load through custom_class.",
        )
        return
    _wrap_worker_init()
    from vllm_specplugin import draft_free_steps, runner_shim, shutdown_repair, tree_verification

    runner_shim.install()
    tree_verification.install()
    draft_free_steps.install()  # after the tree wrapper: it sees the step's final metadata
    shutdown_repair.apply()  # SIGTERM under load: in-flight requests end with an error, no hang
    from vllm_specplugin import lossy_acceptance

    lossy_acceptance.install()  # opt-in lossy acceptance modes (per request or server-wide); exact rows untouched


def _wrap_engine_config_validation() -> None:
    """Validate ``additional_config['specplugin']`` as the engine config is built (start-up)."""
    from vllm.engine.arg_utils import EngineArgs

    wrap_once(EngineArgs, "create_engine_config", _validating_create_engine_config)


def _validating_create_engine_config(original):
    def create_engine_config(self, *args, **kwargs):
        vllm_config = original(self, *args, **kwargs)
        config = SpecPluginConfig.from_additional_config(vllm_config.additional_config)
        _check_against_engine(config, vllm_config)
        from vllm_specplugin import metrics

        parallel = vllm_config.parallel_config  # several API servers: each reads the parent's directory
        metrics.prepare_metrics_dir(getattr(parallel, "_api_process_count", 1),
                                    getattr(parallel, "_api_process_rank", 0))
        return vllm_config

    return create_engine_config


def _check_against_engine(config: SpecPluginConfig, vllm_config) -> None:
    """Settings that are valid alone but impossible with this engine's speculative config."""
    from vllm_specplugin.config import SpecPluginConfigError

    policy = config.gamma_policy()
    spec = vllm_config.speculative_config
    if policy is not None and spec is not None and policy.gamma_min > spec.num_speculative_tokens:
        raise SpecPluginConfigError(
            "adaptive_gamma.gamma_min",
            f"is {policy.gamma_min}, above num_speculative_tokens = {spec.num_speculative_tokens} (the largest gamma)",
        )
    from vllm_specplugin import lossy_acceptance

    lossy_acceptance.check_engine(config, vllm_config)  # a server-wide lossy mode: possible here? (warns)
    from vllm_specplugin import rejection_methods

    rejection_methods.check_engine(vllm_config)  # "block" refused for the plugin's proposers, warnings


def _wrap_worker_init() -> None:
    """Apply the CPU sampler repair after the platform registers its kernel fallbacks.

    In a worker process, ``WorkerWrapperBase.init_worker`` loads general plugins (this code)
    first and registers the platform's fallbacks second, so a repair registered at plugin load
    is overwritten, and a wrapper of ``init_worker`` itself comes too late for that call.
    ``init_device`` is the next call on the same wrapper, so the repair goes there.
    """
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    def repairing_init_device(original):
        def init_device(self):
            config = SpecPluginConfig.from_additional_config(
                getattr(self.vllm_config, "additional_config", None)
            )
            from vllm_specplugin import compile_cache_repair, generator_repair, sampler_repair

            compile_cache_repair.apply()  # before the model is compiled: load vLLM's saved compile (CPU)
            sampler_repair.apply(config.cpu_sampler_repair)
            if config.cpu_generator_repair != "off":
                generator_repair.apply()  # seeded requests with a chunked prefill (CPU generators)
            if config.tree_verify == "tree":
                # Before the model (and so its attention layers) is built in this worker.
                from vllm_specplugin import tree_verification

                tree_verification.register_backend()
            return original(self)

        return init_device

    wrap_once(WorkerWrapperBase, "init_device", repairing_init_device)
