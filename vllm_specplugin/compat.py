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
    _check_draft_kernels_internals(need)
    _check_tree_verification_internals(need)
    _check_empty_top_k_internals(need)
    _check_shutdown_internals(need)
    _check_generator_repair_internals(need)
    _check_compile_cache_internals(need)
    _check_draft_free_internals(need)
    _check_lossy_acceptance_internals(need)
    _check_tensor_parallel_internals(need)
    _check_carried_q_internals(need)
    _check_rejection_methods_internals(need)
    _check_metrics_internals(need)
    return problems


def _check_metrics_internals(need) -> None:
    """vllm_specplugin.metrics with several API servers (``--api-server-count``): the parent builds the
    engine config with rank -1 and sets PROMETHEUS_MULTIPROC_DIR; each API server builds it again with
    its own rank and serves /metrics through prometheus_client's MultiProcessCollector only."""
    from prometheus_client import multiprocess
    from prometheus_fastapi_instrumentator import Instrumentator
    from vllm.config import ParallelConfig
    from vllm.entrypoints.cli import serve
    from vllm.entrypoints.launchers.api_server import entry
    from vllm.entrypoints.serve.instrumentator import metrics as instrumentator_metrics

    multi_src = inspect.getsource(serve.run_multi_api_server)
    need("setup_multiprocess_prometheus()" in multi_src and "_api_process_rank = -1" in multi_src
         and multi_src.find("create_engine_config(") < multi_src.find("APIServerProcessManager("),
         "run_multi_api_server: multiprocess prometheus, config built with rank -1 before the API servers start")
    need('_api_process_rank = client_config.get("client_index", 0)' in inspect.getsource(entry.build_async_engine_client),
         "an API server of several builds its engine config with its own rank (client_index)")
    parallel_src = inspect.getsource(ParallelConfig)
    need("_api_process_count: int" in parallel_src and "_api_process_rank: int" in parallel_src,
         "ParallelConfig._api_process_count / _api_process_rank")
    need(".expose(app" in inspect.getsource(instrumentator_metrics.attach_router),
         "vLLM serves /metrics through prometheus_fastapi_instrumentator's expose()")
    expose_src = inspect.getsource(Instrumentator.expose)
    need('"PROMETHEUS_MULTIPROC_DIR" in os.environ' in expose_src and "MultiProcessCollector(" in expose_src,
         "Instrumentator.expose serves a registry with only a MultiProcessCollector in multiprocess mode")
    need(callable(getattr(multiprocess.MultiProcessCollector, "collect", None)), "MultiProcessCollector.collect")


def _check_lossy_acceptance_internals(need) -> None:
    """vllm_specplugin.lossy_acceptance: what it wraps (request validation, _sample, rejection_sample) and
    the shapes it reads and rewrites."""
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    validate = inspect.unwrap(InputProcessor._validate_params)
    need(list(inspect.signature(validate).parameters)[:2] == ["self", "params"],
         "InputProcessor._validate_params(self, params, ...)")
    need("self._validate_params(params" in inspect.getsource(InputProcessor.process_inputs),
         "InputProcessor.process_inputs validates each request's params through self._validate_params")
    need("self.vllm_config = vllm_config" in inspect.getsource(InputProcessor.__init__), "InputProcessor.vllm_config")
    need(list(inspect.signature(inspect.unwrap(rejection_sampler.rejection_sample)).parameters)[:8] == [
        "draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens", "draft_probs",
        "target_logits", "bonus_token_ids", "sampling_metadata"],
        "rejection_sampler.rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, "
        "draft_probs, target_logits, bonus_token_ids, sampling_metadata, ...)")
    forward = inspect.getsource(rejection_sampler.RejectionSampler.forward)
    need("output_token_ids = rejection_sample(" in forward, "RejectionSampler.forward calls the module-level rejection_sample")
    need(forward.find("apply_sampling_constraints(") < forward.find("output_token_ids = rejection_sample("),
         "rejection_sample receives target logits already processed (temperature, top-k, top-p)")
    body = inspect.getsource(inspect.unwrap(rejection_sampler.rejection_sample))
    need("(batch_size, max_spec_len + 1)" in body and "PLACEHOLDER_TOKEN_ID" in body,
         "rejection_sample returns [batch, max_spec_len + 1] int32 padded with PLACEHOLDER_TOKEN_ID (-1)")
    need({"temperature", "generators", "all_greedy"} <= {f.name for f in __import__("dataclasses").fields(SamplingMetadata)},
         "SamplingMetadata.temperature / generators / all_greedy")
    need("self.rejection_sampler(" in inspect.getsource(inspect.unwrap(GPUModelRunner._sample)),
         "GPUModelRunner._sample calls the rejection sampler (the per-row settings are set around it)")
    need("self.requests: dict[str, CachedRequestState]" in inspect.getsource(GPUModelRunner.__init__),
         "GPUModelRunner.requests (request id -> state with sampling_params.extra_args)")


def _check_draft_free_internals(need) -> None:
    """vllm_specplugin.draft_free_steps: _prepare_inputs' result it rewrites, and the paths that read it."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    prepare = inspect.getsource(inspect.unwrap(GPUModelRunner._prepare_inputs))
    need("tuple[logits_indices, spec_decode_metadata, max_num_sampled_tokens]" in prepare,
         "GPUModelRunner._prepare_inputs returns (logits_indices, spec_decode_metadata, max_num_sampled_tokens)")
    need("logits_indices = query_start_loc[1:] - 1" in prepare,
         "_prepare_inputs: a plain engine samples at each request's last scheduled token")
    need("if spec_decode_metadata is None:\n            return self.sampler(" in inspect.getsource(
        inspect.unwrap(GPUModelRunner._sample)), "GPUModelRunner._sample takes the plain sampler without metadata")
    propose = inspect.getsource(inspect.unwrap(GPUModelRunner.propose_draft_token_ids))
    custom = propose[propose.find('spec_config.method == "custom_class"'):]
    custom = custom[:custom.find("elif ")]
    need("self.drafter).propose(" in custom and "spec_decode_metadata" not in custom,
         "the custom_class branch of propose_draft_token_ids does not read spec_decode_metadata")


def _check_generator_repair_internals(need) -> None:
    """vllm_specplugin.generator_repair: the discarded-sample rewind it replaces, and what it reads."""
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    bookkeeping = inspect.getsource(inspect.unwrap(GPUModelRunner._bookkeeping_sync))
    need("self.discard_request_mask.np[:num_reqs]" in bookkeeping and "gen.set_offset(gen.get_offset() - 4)" in bookkeeping
         and "self.input_batch.generators.get(int(i))" in bookkeeping,
         "GPUModelRunner._bookkeeping_sync rewinds the discarded rows' generators by offset")
    need("self.discard_request_mask.np[:num_reqs] = (" in inspect.getsource(GPUModelRunner._prepare_inputs),
         "GPUModelRunner._prepare_inputs sets discard_request_mask before sampling")
    need("self.generators: dict[int, torch.Generator] = {}" in inspect.getsource(InputBatch.__init__),
         "InputBatch.generators: batch row -> torch.Generator")


def _check_compile_cache_internals(need) -> None:
    """vllm_specplugin.compile_cache_repair: vLLM's AOT-compile load path and torch's bundled wrapper."""
    import torch._dynamo.aot_compile_types as aot_types
    from vllm.compilation import decorators

    load = inspect.getsource(inspect.unwrap(decorators._try_load_aot_compiled_fn))
    need("torch.compiler.load_compiled_function(" in load
         and "loaded_fn._artifacts.compiled_fn.finalize_loading(model.vllm_config)" in load,
         "decorators._try_load_aot_compiled_fn loads with torch.compiler.load_compiled_function, then calls "
         "loaded_fn._artifacts.compiled_fn.finalize_loading(model.vllm_config)")
    bundled = getattr(aot_types, "BundledAOTAutogradSerializableCallable", None)
    need(bundled is not None and isinstance(bundled.__dict__.get("deserialize_compile_artifacts"), classmethod),
         "torch._dynamo.aot_compile_types.BundledAOTAutogradSerializableCallable.deserialize_compile_artifacts "
         "(classmethod)")
    need(bundled is not None and "__getattr__" in bundled.__dict__ and "finalize_loading" not in bundled.__dict__,
         "BundledAOTAutogradSerializableCallable forwards attributes to its compiled function and has no "
         "finalize_loading of its own")


def _check_shutdown_internals(need) -> None:
    """vllm_specplugin.shutdown_repair: AsyncLLM.shutdown stops the engine, then cancels the output
    handler, the only task that fails in-flight requests; the API server calls it on SIGTERM."""
    from vllm.entrypoints.launchers import launcher
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.output_processor import OutputProcessor

    shutdown = inspect.unwrap(AsyncLLM.shutdown)
    need(list(inspect.signature(shutdown).parameters)[:2] == ["self", "timeout"], "AsyncLLM.shutdown(self, timeout)")
    source = inspect.getsource(shutdown)
    need("engine_core.shutdown(" in source and "cancel_task_threadsafe(handler)" in source,
         "AsyncLLM.shutdown stops the engine core, then cancels the output handler task")
    need(callable(getattr(OutputProcessor, "propagate_error", None))
         and callable(getattr(OutputProcessor, "get_num_unfinished_requests", None)),
         "OutputProcessor.propagate_error / get_num_unfinished_requests")
    need("self.output_handler: asyncio.Task | None" in inspect.getsource(AsyncLLM.__init__),
         "AsyncLLM.output_handler is the asyncio task that owns the request queues' loop")
    need("engine_client.shutdown, timeout=timeout" in inspect.getsource(launcher.serve_http),
         "the API server calls engine_client.shutdown on SIGTERM/SIGINT")


def _check_empty_top_k_internals(need) -> None:
    """vllm_specplugin.sampler_repair.apply_empty_top_k_repair: the rejection sampler runs in every
    step of a speculative engine (drafts or not) and masks top-k/top-p through the module-level
    ``apply_top_k_top_p`` it imported, which the repair wraps."""
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    need(callable(getattr(rejection_sampler, "apply_top_k_top_p", None)), "rejection_sampler.apply_top_k_top_p")
    need(list(inspect.signature(rejection_sampler.apply_top_k_top_p).parameters) == ["logits", "k", "p"],
         "rejection_sampler.apply_top_k_top_p(logits, k, p)")
    need("return apply_top_k_top_p(logits, top_k, top_p)" in inspect.getsource(rejection_sampler.apply_sampling_constraints),
         "apply_sampling_constraints masks through the module-level apply_top_k_top_p")
    need("use_spec_decode = self.speculative_config is not None" in inspect.getsource(GPUModelRunner._prepare_inputs),
         "every step of a speculative engine builds spec-decode metadata (steps without drafts reach the sampler)")


def _check_tree_verification_internals(need) -> None:
    """What vllm_specplugin.tree_verification reads, wraps and overrides (tree_drafting.verify = tree)."""
    import dataclasses

    from vllm.config import VllmConfig
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends import cpu_attn, registry
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.sampling_params import SamplingParams

    from vllm_specplugin import tree_verification

    # The backend: CPU_ATTN overridable through the registry; the subclass built; the selector cached.
    need(hasattr(registry.AttentionBackendEnum, "CPU_ATTN") and callable(getattr(registry, "register_backend", None)),
         "registry.register_backend(AttentionBackendEnum.CPU_ATTN, class_path)")
    need(callable(getattr(getattr(selector, "_cached_get_attn_backend", None), "cache_clear", None)),
         "attention selector._cached_get_attn_backend is an lru cache")
    try:
        backend, tree_impl = tree_verification.backend_classes()
        need(issubclass(backend, cpu_attn.CPUAttentionBackend) and backend.get_impl_cls() is tree_impl
             and backend.get_name() == "CPU_ATTN", "TreeCPUAttentionBackend subclasses CPU_ATTN with its impl")
    except Exception as exc:  # noqa: BLE001 - reported as a problem
        need(False, f"tree_verification.backend_classes() failed: {exc!r}")
    impl = cpu_attn.CPUAttentionBackendImpl
    forward = list(inspect.signature(impl.forward).parameters)
    need(forward[:8] == ["self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"],
         f"CPUAttentionBackendImpl.forward(self, layer, query, key, value, kv_cache, attn_metadata, output, ...), "
         f"got {forward}")
    update = list(inspect.signature(impl.do_kv_cache_update).parameters)
    need(update == ["self", "layer", "key", "value", "kv_cache", "slot_mapping"],
         f"CPUAttentionBackendImpl.do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping), got {update}")
    need(cpu_attn.CPUAttentionBackend.forward_includes_kv_cache_update is False,
         "CPU attention writes the KV cache before forward (do_kv_cache_update), so tree K/V are in the cache")
    forward_src = inspect.getsource(impl.forward)
    need("kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))" in forward_src
         and "key_cache, value_cache = kv_cache.chunk(2, dim=2)" in forward_src,
         "CPU KV cache [num_blocks, H_kv, B, 2D] holds a K region then a V region per block and head")
    fields = {f.name for f in dataclasses.fields(cpu_attn.CPUAttentionMetadata)}
    need({"seq_lens", "block_table", "slot_mapping", "query_start_loc"} <= fields,
         "CPUAttentionMetadata.seq_lens / block_table / slot_mapping / query_start_loc")
    for name in ("sliding_window", "alibi_slopes", "logits_soft_cap", "sinks", "kv_sharing_target_layer_name",
                 "scale", "attn_type"):
        need(f"self.{name} =" in inspect.getsource(impl.__init__), f"CPUAttentionBackendImpl keeps self.{name}")
    need("attn_layer.kv_cache" in inspect.getsource(
        __import__("vllm.model_executor.layers.attention.attention", fromlist=["x"]).get_attention_context),
        "Attention layers keep their KV cache tensor in .kv_cache")
    need(Attention is not None, "vllm.model_executor.layers.attention.Attention")
    # The CUDA path (untested on a GPU): read as source text, so no CUDA backend is imported here.
    import importlib.util

    for spec in tree_verification.CUDA_BACKENDS:
        found = importlib.util.find_spec(spec.module)
        source = open(found.origin).read() if found is not None and found.origin else ""
        need(f"class {spec.backend_class}(" in source and f"class {spec.impl_class}(" in source
             and spec.name in registry.AttentionBackendEnum.__members__,
             f"{spec.module}: {spec.backend_class} / {spec.impl_class}, routed as {spec.name}")
        need("key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)" in source
             and "def do_kv_cache_update(" in source and "forward_includes_kv_cache_update: bool = False" in source,
             f"{spec.module}: cache [num_blocks, H_kv, B, 2D] with token rows [K | V], written by "
             "do_kv_cache_update before forward")
    # The runner: positions then slot mapping in _prepare_inputs; logits rows per request; sampling.
    prepare = inspect.unwrap(GPUModelRunner._prepare_inputs)
    need(list(inspect.signature(prepare).parameters) == ["self", "scheduler_output", "num_scheduled_tokens"],
         "GPUModelRunner._prepare_inputs(self, scheduler_output, num_scheduled_tokens)")
    prepare_src = inspect.getsource(prepare)
    positions_at = prepare_src.find("self.positions[:total_num_scheduled_tokens] = (")
    slots_at = prepare_src.find("compute_slot_mapping(")
    need(0 <= positions_at < slots_at, "_prepare_inputs computes the slot mapping from positions it wrote before")
    need("self.query_start_loc.np[1 : num_reqs + 1] = cu_num_tokens" in prepare_src,
         "_prepare_inputs fills query_start_loc.np per batch row")
    sample = inspect.unwrap(GPUModelRunner._sample)
    need(list(inspect.signature(sample).parameters) == ["self", "logits", "spec_decode_metadata"],
         "GPUModelRunner._sample(self, logits, spec_decode_metadata)")
    spec_src = inspect.getsource(GPUModelRunner._calc_spec_decode_metadata)
    need("bonus_logits_indices = cu_num_sampled_tokens - 1" in spec_src
         and "num_draft_tokens=num_draft_tokens.tolist()" in spec_src,
         "logits hold num_draft + 1 consecutive rows per request, in batch order")
    tokens_src = inspect.getsource(GPUModelRunner.sample_tokens)
    sample_at = tokens_src.find("self._sample(")
    need(0 <= sample_at < tokens_src.find("self._bookkeeping_sync(") and sample_at < tokens_src.find(
        "self.propose_draft_token_ids("), "sample_tokens samples before bookkeeping and drafting")
    need("RejectionSampler.parse_output(" in inspect.getsource(GPUModelRunner._bookkeeping_sync),
         "_bookkeeping_sync parses spec-decode rows with RejectionSampler.parse_output")
    need(rejection_sampler.PLACEHOLDER_TOKEN_ID == -1, "rejection_sampler.PLACEHOLDER_TOKEN_ID == -1")
    need(list(inspect.signature(rejection_sampler.apply_sampling_constraints).parameters)
         == ["logits", "cu_num_draft_tokens", "sampling_metadata"],
         "rejection_sampler.apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata)")
    meta = {f.name for f in dataclasses.fields(SamplingMetadata)}
    need({"temperature", "top_k", "top_p", "all_greedy", "all_random"} <= meta,
         "SamplingMetadata.temperature / top_k / top_p / all_greedy / all_random")
    need(callable(getattr(GPUModelRunner, "initialize_kv_cache", None)), "GPUModelRunner.initialize_kv_cache")
    init_src = inspect.getsource(GPUModelRunner.__init__)
    need("self.positions = torch.zeros(" in init_src, "GPUModelRunner.positions is a plain tensor")
    need("self.query_start_loc = self._make_buffer(" in init_src, "GPUModelRunner.query_start_loc is a CpuGpuBuffer")
    need("self.req_id_to_index" in inspect.getsource(InputBatch.__init__), "InputBatch.req_id_to_index")
    need("sampling_params" in {f.name for f in dataclasses.fields(CachedRequestState)},
         "CachedRequestState.sampling_params")
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "bad_words", "min_tokens",
                 "structured_outputs", "logprobs", "prompt_logprobs", "logit_bias", "allowed_token_ids", "min_p"):
        need(hasattr(SamplingParams(), name), f"SamplingParams.{name}")
    # Async scheduling is off for custom_class (only EAGLE/MTP/draft model/ngram-GPU/... allow it), so
    # the compaction after sampling runs before the next forward (check_runner also refuses async).
    need("Currently, async scheduling is only supported" in inspect.getsource(VllmConfig),
         "VllmConfig refuses async scheduling for custom_class speculative decoding")


def _check_draft_kernels_internals(need) -> None:
    """vllm_specplugin.draft_kernels: the drafts' kernels are vLLM's own CPU ops, with these schemas."""
    import torch
    from vllm import _custom_ops as ops

    need(hasattr(ops, "_supports_onednn"), "vllm._custom_ops._supports_onednn")
    create = list(inspect.signature(ops.create_onednn_mm).parameters) if hasattr(ops, "create_onednn_mm") else []
    need(create[:2] == ["weight", "primitive_cache_size"],
         f"vllm._custom_ops.create_onednn_mm(weight [K, N], primitive_cache_size), got {create}")
    mm = list(inspect.signature(ops.onednn_mm).parameters) if hasattr(ops, "onednn_mm") else []
    need(mm[:3] == ["dnnl_handler", "x", "bias"], f"vllm._custom_ops.onednn_mm(dnnl_handler, x, bias), got {mm}")
    if hasattr(ops, "onednn_mm"):  # the one-row fast path writes products with the out form (proposers/lean_decode.py)
        source = inspect.getsource(ops.onednn_mm)
        need("torch.ops._C.onednn_mm(" in source and "dnnl_handler.handler_tensor" in source,
             "vllm._custom_ops.onednn_mm calls torch.ops._C.onednn_mm(out, x, bias, dnnl_handler.handler_tensor)")
        need("handler.handler_tensor = " in inspect.getsource(ops.create_onednn_mm),
             "vllm._custom_ops.create_onednn_mm sets handler.handler_tensor")
    if getattr(ops, "_supports_onednn", False):  # the CPU build: its C++ kernels are there too
        expected = {
            "rms_norm": ["out", "input", "weight", "epsilon"],
            "fused_add_rms_norm": ["input", "residual", "weight", "epsilon"],
            "rotary_embedding": ["positions", "query", "key", "head_size", "cos_sin_cache", "is_neox"],
            "silu_and_mul": ["out", "input"],
            "onednn_mm": ["c", "a", "bias", "handler_tensor"],
        }
        for name, arguments in expected.items():
            op = getattr(torch.ops._C, name, None)
            got = [a.name for a in op.default._schema.arguments] if op is not None else "missing"
            need(got != "missing" and got[:len(arguments)] == arguments,
                 f"torch.ops._C.{name}({', '.join(arguments)}, ...), got {got}")


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
    # EAGLE-3 heads (runner_shim.aux_hidden_states_for_the_head): the setup load_model calls, the flag
    # execute_model reads to split (hidden, aux) and the aux states handed to propose_draft_token_ids.
    setup = inspect.getsource(GPUModelRunner._setup_eagle3_aux_hidden_state_outputs) if hasattr(
        GPUModelRunner, "_setup_eagle3_aux_hidden_state_outputs") else ""
    need("if not self.use_aux_hidden_state_outputs:" in setup and "set_aux_hidden_state_layers(" in setup,
         "GPUModelRunner._setup_eagle3_aux_hidden_state_outputs sets the model's aux layers when "
         "use_aux_hidden_state_outputs")
    need("hidden_states, aux_hidden_states = model_output" in inspect.getsource(GPUModelRunner.execute_model),
         "execute_model splits (hidden_states, aux_hidden_states) when use_aux_hidden_state_outputs")
    need("aux_hidden_states" in params, "propose_draft_token_ids receives aux_hidden_states")
    from vllm.v1.worker import cpu_model_runner

    need("self._setup_eagle3_aux_hidden_state_outputs()" in inspect.getsource(cpu_model_runner.CPUModelRunner.load_model),
         "CPUModelRunner.load_model calls _setup_eagle3_aux_hidden_state_outputs after loading the drafter")
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


def _check_tensor_parallel_internals(need) -> None:
    """vllm_specplugin.tensor_parallel: every TP rank samples itself and verifies the output rank's
    drafts against its own q; the agreement all-gathers over the TP group's CPU group."""
    from vllm.distributed import parallel_state
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    need(callable(getattr(parallel_state, "get_tp_group", None)), "vllm.distributed.parallel_state.get_tp_group")
    need(callable(getattr(parallel_state, "get_tensor_model_parallel_rank", None)),
         "vllm.distributed.parallel_state.get_tensor_model_parallel_rank")
    coordinator_init = inspect.getsource(parallel_state.GroupCoordinator.__init__)
    need(all(f"self.{a}" in coordinator_init for a in ("cpu_group", "rank_in_group", "world_size")),
         "GroupCoordinator.cpu_group / rank_in_group / world_size")
    need("unique_reply_rank=self.output_rank" in inspect.getsource(MultiprocExecutor.take_draft_token_ids),
         "MultiprocExecutor.take_draft_token_ids replies from the output rank only")
    update = inspect.getsource(GPUModelRunner._update_states)
    need("if not is_last_rank:" in update and "new_token_ids" in update,
         "GPUModelRunner._update_states takes the scheduler's new_token_ids only on non-last pipeline ranks "
         "(every TP rank appends its own sampled tokens)")
    from vllm.v1.worker.gpu_input_batch import InputBatch

    batch_init = inspect.getsource(InputBatch.__init__)
    need("self.num_tokens_no_spec =" in batch_init and "self.token_ids_cpu =" in batch_init
         and isinstance(getattr(InputBatch, "req_ids", None), property)
         and isinstance(getattr(InputBatch, "num_reqs", None), property),
         "InputBatch.num_tokens_no_spec / token_ids_cpu / req_ids / num_reqs (hashed per row by the TP agreement)")


def _check_rejection_methods_internals(need) -> None:
    """vllm_specplugin.rejection_methods: block verification exists only in Model Runner V2, V2 does
    not run custom_class proposers, and V1's rejection sampler has no block path (why the plugin
    refuses "block"); V1 keeps draft probabilities only for "standard"."""
    from vllm.config import VllmConfig
    from vllm.config.speculative import SpeculativeConfig
    from vllm.v1.sample import rejection_sampler as v1_sampler
    from vllm.v1.spec_decode import llm_base_proposer
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler as v2_sampler

    methods = getattr(SpeculativeConfig.__dataclass_fields__.get("rejection_sample_method"), "type", "")
    need(all(m in str(methods) for m in ("standard", "block", "synthetic")),
         f"SpeculativeConfig.rejection_sample_method: standard | block | synthetic, got {methods}")
    need(isinstance(getattr(VllmConfig, "use_v2_model_runner", None), property), "VllmConfig.use_v2_model_runner")
    unsupported = inspect.getsource(VllmConfig._get_v2_model_runner_unsupported_features)
    need('"custom_class"' in unsupported, "Model Runner V2 does not run custom_class proposers (V1 is used)")
    need('"block"' not in inspect.getsource(v1_sampler),
         "the V1 rejection sampler has no block verification (a block path there would make the refusal stale)")
    need('rejection_sample_method == "block"' in inspect.getsource(v2_sampler),
         "Model Runner V2's RejectionSampler implements rejection_sample_method == 'block'")
    need('rejection_sample_method == "standard"' in inspect.getsource(llm_base_proposer),
         "V1 draft_model/EAGLE keep draft probabilities only for rejection_sample_method == 'standard'")


def _check_carried_q_internals(need) -> None:
    """runner_shim._carried_q: the scheduler keeps the drafts of a running request it skips for a step
    (it clears them only when it schedules the request), and the runner looks q up by request id in
    the last hand-over only, falling back to one-hot verification of the whole step on a miss (the
    warning tests/e2e/test_seeded_reproducibility.py looks for)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    lookup = inspect.getsource(GPUModelRunner._get_spec_decode_draft_probs)
    need("self._draft_prob_req_ids" in lookup and "Missing cached draft probabilities" in lookup,
         "GPUModelRunner._get_spec_decode_draft_probs looks q up by request id in _draft_prob_req_ids and warns "
         "'Missing cached draft probabilities' on a miss")
    need("request.spec_token_ids = []" in inspect.getsource(Scheduler.schedule),
         "Scheduler.schedule clears a request's drafts only when it schedules the request")
    schedule = inspect.getsource(Scheduler.schedule)
    need("Pad new decode requests to uniform spec decoding size" in schedule
         and "scheduled_spec_decode_tokens[request_id] = [\n                        -1\n                    ] * self.num_spec_tokens"
         in schedule,
         "Scheduler.schedule pads a request admitted with one token to compute with num_spec_tokens placeholder "
         "drafts (-1); runner_shim gives them a zero q, sampler_repair makes the CPU kernel reject them")
    from vllm.utils import cpu_triton_utils

    need(list(inspect.signature(cpu_triton_utils._rejection_random_sample_kernel_impl).parameters)[:11] == [
        "output_token_ids", "cu_num_draft_tokens", "draft_token_ids", "draft_probs", "target_probs",
        "bonus_token_ids", "recovered_token_ids", "uniform_probs", "is_greedy", "max_spec_len", "vocab_size"],
        "cpu_triton_utils._rejection_random_sample_kernel_impl(output_token_ids, cu_num_draft_tokens, "
        "draft_token_ids, draft_probs, target_probs, bonus_token_ids, recovered_token_ids, uniform_probs, "
        "is_greedy, max_spec_len, vocab_size, ...) (sampler_repair's placeholder probe and wrapper)")
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    fields = getattr(SpecDecodeMetadata, "__dataclass_fields__", {})
    need("draft_token_ids" in fields and "num_draft_tokens" in fields,
         "SpecDecodeMetadata.draft_token_ids ([total drafts], batch order) and num_draft_tokens (per row); "
         "runner_shim._one_hot_only_where_q_is_missing rebuilds the lookup from them")

