"""The vLLM internals the plugin relies on, checked in one function.

``tests/test_vllm_internals.py`` calls :func:`check_vllm_internals` so that a vLLM upgrade that
moves any of them fails loudly in CI instead of silently disabling a repair.
"""

from __future__ import annotations

import inspect


def check_vllm_internals() -> list[str]:
    """Return a list of problems (empty when every relied-on internal is where we expect it)."""
    problems: list[str] = []

    def need(condition: bool, what: str) -> None:
        if not condition:
            problems.append(what)

    from vllm.engine.arg_utils import EngineArgs
    from vllm.triton_utils import dispatcher
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    need(callable(getattr(EngineArgs, "create_engine_config", None)), "EngineArgs.create_engine_config")
    device_params = list(inspect.signature(WorkerWrapperBase.init_device).parameters)
    need(device_params == ["self"], f"WorkerWrapperBase.init_device(self), got {device_params}")
    need("vllm_config" in inspect.getsource(WorkerWrapperBase.init_worker), "init_worker stores self.vllm_config")
    init_src = inspect.getsource(WorkerWrapperBase.init_worker)
    need(
        init_src.find("load_general_plugins()") < init_src.find("register_triton_kernel_overrides()"),
        "init_worker loads plugins before registering platform kernel overrides",
    )
    need(isinstance(getattr(dispatcher, "_registry", None), dict), "triton_utils.dispatcher._registry")
    need(callable(getattr(dispatcher, "register_kernels", None)), "triton_utils.dispatcher.register_kernels")
    need(hasattr(rejection_sampler, "expand_kernel"), "rejection_sampler.expand_kernel")
    kernel_args = tuple(dispatcher._kernel_arg_names(rejection_sampler.expand_kernel)) if hasattr(
        dispatcher, "_kernel_arg_names"
    ) else ()
    need(
        kernel_args[:5] == ("output_ptr", "input_ptr", "cu_num_tokens_ptr", "replace_from", "replace_to"),
        f"expand_kernel launch arguments (output, input, cu_num_tokens, replace_from, replace_to), got {kernel_args}",
    )
    expand_src = inspect.getsource(rejection_sampler.expand_batch_to_tokens)
    need("_expand(" in expand_src, "expand_batch_to_tokens launches _expand")
    return problems
