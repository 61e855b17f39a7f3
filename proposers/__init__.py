"""Engine-agnostic drafting (torch + transformers, no vLLM import).

Planned here: the draft-model runtime with per-request KV caches, the multi-draft ensemble, the
adaptive-gamma controller, the tree builder and prefix sharing. vLLM reaches them only through
the adapters in ``vllm_specplugin.adapters``.
"""
