"""The engine flags a user serves with, for the engines ``specplugin-verify`` starts.

``--dtype``, ``--tensor-parallel-size``, ``--max-model-len``, ``--trust-remote-code`` and
``--gpu-memory-utilization`` mean what they mean for ``vllm serve``; they go to every engine the
harness starts (``drivers.run_offline``: ``vllm.LLM`` arguments; ``drivers.run_http``: the
server's command line). Bad values are refused when parsed, with the flag's name.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_MAX_MODEL_LEN = 512


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """``gpu_memory_utilization`` None: ``SPECPLUGIN_GPU_MEMORY_UTILIZATION`` or 0.3 (CPU default)."""

    dtype: str = "float32"
    tensor_parallel_size: int = 1
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    trust_remote_code: bool = False
    gpu_memory_utilization: float | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.dtype not in DTYPES:
            problems.append(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not _is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            problems.append(f"--tensor-parallel-size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if not _is_int(self.max_model_len) or self.max_model_len < 1:
            problems.append(f"--max-model-len must be an integer >= 1, got {self.max_model_len!r}")
        if self.gpu_memory_utilization is not None and not (
                isinstance(self.gpu_memory_utilization, (int, float)) and 0.0 < self.gpu_memory_utilization <= 1.0):
            problems.append("--gpu-memory-utilization must be a fraction in (0, 1], got "
                            f"{self.gpu_memory_utilization!r}")
        if problems:
            raise ValueError("; ".join(problems))

    def engine_options(self) -> dict:
        """Extra ``vllm.LLM`` arguments for ``drivers.run_offline`` (dtype, max_model_len and the
        memory fraction are its own arguments)."""
        options: dict = {}
        if self.tensor_parallel_size != 1:
            options["tensor_parallel_size"] = self.tensor_parallel_size
        if self.trust_remote_code:
            options["trust_remote_code"] = True
        return options

    def server_args(self) -> list[str]:
        """Extra ``vllm serve`` arguments for ``drivers.run_http`` (dtype and max_model_len are its own)."""
        args = []
        if self.tensor_parallel_size != 1:
            args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.trust_remote_code:
            args.append("--trust-remote-code")
        if self.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}"]
        return args

    def describe(self) -> str:
        parts = [f"dtype={self.dtype}", f"max_model_len={self.max_model_len}"]
        if self.tensor_parallel_size != 1:
            parts.append(f"tensor_parallel_size={self.tensor_parallel_size}")
        if self.trust_remote_code:
            parts.append("trust_remote_code")
        if self.gpu_memory_utilization is not None:
            parts.append(f"gpu_memory_utilization={self.gpu_memory_utilization:g}")
        return " ".join(parts)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(flag: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer >= 1, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer >= 1, got {text!r}")
        return value

    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpu-memory-utilization must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"--gpu-memory-utilization must be a fraction in (0, 1], got {text!r}")
    return value


def add_engine_arguments(parser: argparse.ArgumentParser, *, default_dtype: str = "float32") -> None:
    group = parser.add_argument_group("engine (as for vllm serve; passed to every engine the harness starts)")
    group.add_argument("--dtype", choices=DTYPES, default=default_dtype,
                       help=f"model dtype (default {default_dtype})")
    group.add_argument("--tensor-parallel-size", type=_positive_int("--tensor-parallel-size"), default=1,
                       help="tensor-parallel ranks per engine (on vLLM-CPU also set VLLM_CPU_OMP_THREADS_BIND, "
                            "e.g. '0|1')")
    group.add_argument("--max-model-len", type=_positive_int("--max-model-len"), default=DEFAULT_MAX_MODEL_LEN)
    group.add_argument("--trust-remote-code", action="store_true", help="as for vllm serve")
    group.add_argument("--gpu-memory-utilization", type=_fraction, default=None,
                       help="fraction in (0, 1]; default: $SPECPLUGIN_GPU_MEMORY_UTILIZATION or 0.3 (a CPU "
                            "default: on a GPU pass what you serve with, e.g. 0.9)")


def settings_from_args(args: argparse.Namespace) -> EngineSettings:
    return EngineSettings(dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
                          max_model_len=args.max_model_len, trust_remote_code=args.trust_remote_code,
                          gpu_memory_utilization=args.gpu_memory_utilization)


def engine_driver(model: str, settings: EngineSettings, *, speculative_config: dict | None = None,
                  additional_config: dict | None = None, driver: str = "offline", extra_env: dict | None = None,
                  log_path: str | None = None, engine_options: dict | None = None):
    """``driver(tasks) -> EngineRun`` for one fresh engine with these settings (``drivers.run_offline``
    or ``drivers.run_http``). ``engine_options``: more ``vllm.LLM`` arguments (offline only)."""
    from vllm_specplugin.verification import drivers

    if driver == "offline":
        def run(tasks):
            return drivers.run_offline(
                model, tasks, speculative_config=speculative_config, additional_config=additional_config,
                dtype=settings.dtype, max_model_len=settings.max_model_len, extra_env=extra_env, log_path=log_path,
                engine_options={**settings.engine_options(), **(engine_options or {})},
                gpu_memory_utilization=settings.gpu_memory_utilization)
    elif driver == "http":
        if engine_options:
            raise ValueError("engine_options are for the offline driver")

        def run(tasks):
            return drivers.run_http(
                model, tasks, speculative_config=speculative_config, additional_config=additional_config,
                dtype=settings.dtype, max_model_len=settings.max_model_len, extra_env=extra_env,
                extra_args=settings.server_args())
    else:
        raise ValueError(f"driver must be 'offline' or 'http', got {driver!r}")
    run.__name__ = f"{driver} {settings.describe()}"
    return run
