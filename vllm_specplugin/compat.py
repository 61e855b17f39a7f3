"""The vLLM internals the plugin relies on, checked in one function.

``tests/test_plugin.py::test_vllm_internals_have_not_moved`` calls :func:`check_vllm_internals`
so that a vLLM upgrade that moves any of them fails loudly in CI instead of silently disabling a
repair or corrupting the draft probabilities the runner shim hands over.
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
    _check_draft_gemm_internals(need)
    return problems


def _check_draft_gemm_internals(need) -> None:
    """vllm_specplugin.fast_linear: the drafts' oneDNN products are vLLM's own CPU GEMM ops."""
    from vllm import _custom_ops as ops

    need(hasattr(ops, "_supports_onednn"), "vllm._custom_ops._supports_onednn")
    create = list(inspect.signature(ops.create_onednn_mm).parameters) if hasattr(ops, "create_onednn_mm") else []
    need(create[:2] == ["weight", "primitive_cache_size"],
         f"vllm._custom_ops.create_onednn_mm(weight [K, N], primitive_cache_size), got {create}")
    mm = list(inspect.signature(ops.onednn_mm).parameters) if hasattr(ops, "onednn_mm") else []
    need(mm[:3] == ["dnnl_handler", "x", "bias"], f"vllm._custom_ops.onednn_mm(dnnl_handler, x, bias), got {mm}")


def _check_runner_shim_internals(need) -> None:
    """What vllm_specplugin.runner_shim and vllm_specplugin.adapters read and write on the model
    runner, and the order of events that makes reusing one q buffer across steps safe."""
    from vllm.config import SchedulerConfig
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    propose = inspect.unwrap(GPUModelRunner.propose_draft_token_ids)
    params = list(inspect.signature(propose).parameters)
    need(params[:3] == ["self", "scheduler_output", "sampled_token_ids"],
         f"GPUModelRunner.propose_draft_token_ids(self, scheduler_output, sampled_token_ids, ...), got {params}")
    source = inspect.getsource(propose)
    need('method == "custom_class"' in source and "self.drafter).propose(" in source,
         "propose_draft_token_ids calls a custom_class drafter's propose()")
    custom = source[source.find('method == "custom_class"'):]
    need(custom.find("sampled_token_ids,") < custom.find("self.input_batch.num_tokens_no_spec,")
         < custom.find("self.input_batch.token_ids_cpu,") < custom.find("slot_mappings=slot_mappings"),
         "custom_class propose(sampled_token_ids, input_batch.num_tokens_no_spec, input_batch.token_ids_cpu, "
         "slot_mappings=...)")
    need(source.find("self._draft_probs = None") < source.find('method == "custom_class"'),
         "propose_draft_token_ids clears _draft_probs before drafting (the shim sets it after)")
    reader = inspect.getsource(GPUModelRunner._get_spec_decode_draft_probs)
    need("self._draft_probs[row_idx, :num_draft]" in reader and "self._draft_prob_req_ids" in reader,
         "_get_spec_decode_draft_probs reads _draft_probs[row, :num_draft] keyed by _draft_prob_req_ids")
    need("zip(\n            self.input_batch.req_ids, spec_decode_metadata.num_draft_tokens" in reader
         or "zip(self.input_batch.req_ids, spec_decode_metadata.num_draft_tokens" in reader,
         "_get_spec_decode_draft_probs walks the current batch's req_ids with their num_draft_tokens")
    need("if num_draft == 0:" in reader, "_get_spec_decode_draft_probs skips rows without drafts")
    # One q buffer is reused every step (adapters.MultiDraftProposer): safe only while vLLM copies
    # the rows it needs out of _draft_probs, at the next step's sampling, before drafting again.
    need("torch.cat(draft_probs_rows" in reader,
         "_get_spec_decode_draft_probs copies the rows it reads (torch.cat), so the q buffer may be reused")
    sampler = inspect.getsource(GPUModelRunner.sample_tokens)
    sample_at = sampler.find("self._sample(")
    cleared_at = sampler.find("self._draft_probs = None")
    propose_at = sampler.find("self.propose_draft_token_ids(")
    need(0 <= sample_at < cleared_at < propose_at,
         "sample_tokens samples (reading last step's _draft_probs), clears _draft_probs, then drafts")
    need("draft_probs = self._get_spec_decode_draft_probs(" in inspect.getsource(GPUModelRunner._sample),
         "_sample takes the rejection sampler's draft_probs from _get_spec_decode_draft_probs")
    verify = inspect.getsource(rejection_sampler.rejection_sample)
    need("vocab_size = target_logits.shape[-1]" in verify and "draft_probs.ndim == 2" in verify,
         "rejection_sample takes draft_probs [num_tokens, V] with V the target logits' width")
    need("self._draft_probs: torch.Tensor | None" in inspect.getsource(GPUModelRunner.__init__),
         "GPUModelRunner.__init__ declares _draft_probs")
    need("self.requests: dict[str, CachedRequestState]" in inspect.getsource(GPUModelRunner.__init__),
         "GPUModelRunner.requests maps live request ids to their state")
    batch_source = inspect.getsource(InputBatch.__init__)
    for name in ("self.temperature_cpu", "self.top_k_cpu", "self.top_p_cpu", "self.generators", "self._req_ids",
                 "self.num_tokens_no_spec", "self.token_ids_cpu"):
        need(name in batch_source, f"InputBatch keeps {name}")
    need(isinstance(inspect.getattr_static(InputBatch, "req_ids", None), property), "InputBatch.req_ids property")
    add_source = inspect.getsource(InputBatch.add_request)
    need("self.generators[req_index] = request.generator" in add_source,
         "InputBatch.generators maps a row to its seeded request's generator")
    need("self.temperature_cpu[req_index] = 0.0" in add_source,
         "InputBatch stores temperature 0.0 for greedy requests")
    need("max_num_seqs" in getattr(SchedulerConfig, "model_fields", {}) or hasattr(SchedulerConfig, "max_num_seqs"),
         "SchedulerConfig.max_num_seqs (sizes the q buffer)")
