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
    _check_runner_shim_internals(need)
    return problems


def _check_runner_shim_internals(need) -> None:
    """What vllm_specplugin.runner_shim reads and writes on the model runner."""
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    propose = inspect.unwrap(GPUModelRunner.propose_draft_token_ids)
    params = list(inspect.signature(propose).parameters)
    need(params[:3] == ["self", "scheduler_output", "sampled_token_ids"],
         f"GPUModelRunner.propose_draft_token_ids(self, scheduler_output, sampled_token_ids, ...), got {params}")
    source = inspect.getsource(propose)
    need('method == "custom_class"' in source and "self.drafter).propose(" in source,
         "propose_draft_token_ids calls a custom_class drafter's propose()")
    need(source.find("self._draft_probs = None") < source.find('method == "custom_class"'),
         "propose_draft_token_ids clears _draft_probs before drafting (the shim sets it after)")
    reader = inspect.getsource(GPUModelRunner._get_spec_decode_draft_probs)
    need("self._draft_probs[row_idx, :num_draft]" in reader and "self._draft_prob_req_ids" in reader,
         "_get_spec_decode_draft_probs reads _draft_probs[row, :num_draft] keyed by _draft_prob_req_ids")
    need("self._draft_probs: torch.Tensor | None" in inspect.getsource(GPUModelRunner.__init__),
         "GPUModelRunner.__init__ declares _draft_probs")
    need("self.requests: dict[str, CachedRequestState]" in inspect.getsource(GPUModelRunner.__init__),
         "GPUModelRunner.requests maps live request ids to their state")
    batch_source = inspect.getsource(InputBatch.__init__)
    for name in ("self.temperature_cpu", "self.top_k_cpu", "self.top_p_cpu", "self.generators", "self._req_ids"):
        need(name in batch_source, f"InputBatch keeps {name}")
