# Shared environment for scripts that start vLLM on a small CPU machine (sourced, not run).
# KV cache of 1 GiB and a low memory fraction: the CPU worker otherwise reserves most of the
# NUMA node's memory and refuses to start on a 24 GiB machine.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export SPECPLUGIN_GPU_MEMORY_UTILIZATION=${SPECPLUGIN_GPU_MEMORY_UTILIZATION:-0.3}
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1
export DO_NOT_TRACK=1
export TOKENIZERS_PARALLELISM=false
