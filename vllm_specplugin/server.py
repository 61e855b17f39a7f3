"""The real OpenAI-compatible vLLM server on 127.0.0.1, as a context manager.

Starts ``specplugin-vllm serve`` (vLLM's own CLI) in its own process group, in the caller's
current directory (relative model paths mean what they mean to the caller), waits for /health,
and always shuts the whole group down on exit, even when the body raises; on Linux the server
also shuts down when the process that started it dies (``spawn_tied_to_parent``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from vllm_specplugin.paths import require_demo_models


def engine_env() -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


# Run in the child before it becomes the server: on Linux, ask the kernel to send SIGINT (the
# server's graceful shutdown, as stop() sends) when the parent that started it dies, so that a
# killed caller (a benchmark stopped by kill, a crashed test run) leaves no server behind; the
# server runs in its own session, so nothing else would stop it. Then exec the real command.
_TIE_TO_PARENT = """
import ctypes, os, signal, sys
parent = int(sys.argv[1])
ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGINT))  # PR_SET_PDEATHSIG
if os.getppid() != parent:  # the parent died before the tie was made
    sys.exit(1)
# An ignored SIGINT stays ignored across exec (and Python keeps it so): a starter that ignores it
# would make the tie a no-op. The server gets the default, as if started from a shell.
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def spawn_tied_to_parent(args: list[str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(args, **popen_kwargs)``, except that on Linux, called from the main thread,
    the child gets SIGINT when this process dies (``prctl(PR_SET_PDEATHSIG)``, kept across exec; set
    in the child before the exec rather than by a ``preexec_fn``, which is unsafe in a process with
    threads), with SIGINT back at its default action (an ignored signal stays ignored across exec).
    The kernel ties the child to the *thread* that started it, so from any other thread (the soak
    starts its servers from threads that then end) and elsewhere: plain Popen."""
    if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
        args = [sys.executable, "-c", _TIE_TO_PARENT, str(os.getpid()), *args]
    return subprocess.Popen(args, **popen_kwargs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerStartError(RuntimeError):
    pass


PORT_ATTEMPTS = 3  # starts on a fresh port when the chosen one was taken meanwhile


class VllmServer:
    """``with VllmServer(model, speculative_config=...) as server: server.base_url``."""

    def __init__(
        self,
        model: str,
        *,
        speculative_config: dict | None = None,
        additional_config: dict | None = None,
        dtype: str = "float32",
        max_model_len: int = 512,
        extra_args: list[str] | None = None,
        startup_timeout_s: float = 600,
        log_path: str | None = None,
        extra_env: dict | None = None,
    ):
        self.extra_env = extra_env or {}
        self.model = model
        self.speculative_config, self.additional_config = speculative_config, additional_config
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout_s = startup_timeout_s
        self.log_path = log_path or tempfile.mkstemp(prefix="specplugin-server-", suffix=".log")[1]
        self.args = [
            sys.executable, "-m", "vllm_specplugin.cli", "serve", model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--gpu-memory-utilization", os.environ.get("SPECPLUGIN_GPU_MEMORY_UTILIZATION", "0.3"),
            "--seed", "0",
        ]
        if speculative_config:
            self.args += ["--speculative-config", json.dumps(speculative_config)]
        if additional_config:
            self.args += ["--additional-config", json.dumps(additional_config)]
        self.args += extra_args or []
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> VllmServer:
        # A demo model that is not there (outside a checkout, say) stops here with a message that
        # says how to get it, not in vLLM's hub lookup.
        plugin = (self.additional_config or {}).get("specplugin") or {}
        require_demo_models(self.model, (self.speculative_config or {}).get("model"), *plugin.get("drafts", []))
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self._log = open(self.log_path, "w")
            self.process = spawn_tied_to_parent(
                self.args, env={**engine_env(), **self.extra_env}, stdout=self._log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
            try:
                self._wait_healthy()
                return self
            except ServerStartError:
                self.stop()
                # The port was free when chosen, but another process (another server, or a vLLM
                # engine's own sockets) took it during start-up: choose another and start again.
                if attempt == PORT_ATTEMPTS or "Address already in use" not in self.log_tail():
                    raise
                self._new_port()
            except BaseException:
                self.stop()
                raise
        return self

    def _new_port(self) -> None:
        old = str(self.port)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        at = self.args.index("--port") + 1
        assert self.args[at] == old
        self.args[at] = str(self.port)

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(f"server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        raise ServerStartError(f"server not healthy after {self.startup_timeout_s} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30) -> None:
        if self.process is None or self.process.poll() is not None:
            self._close_log()
            return
        pgid = os.getpgid(self.process.pid)
        os.killpg(pgid, signal.SIGINT)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.process.wait()
        # Engine-core and worker children share the group; make sure none outlive the server.
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._close_log()

    def _close_log(self) -> None:
        log = getattr(self, "_log", None)
        if log is not None and not log.closed:
            log.close()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def metrics(self, prefix: str = "vllm:spec_decode") -> dict[str, float]:
        """Prometheus samples from /metrics whose name starts with ``prefix``."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        return parse_prometheus(text, prefix=prefix)


    def settled_metrics(self, prefix: str, timeout_s: float = 30) -> dict[str, float]:
        """Samples read until two reads a second apart agree (for values published with a delay,
        like the plugin's, which workers write every 0.5 s)."""
        previous = None
        deadline = time.monotonic() + timeout_s
        while True:
            samples = self.metrics(prefix)
            if samples == previous or time.monotonic() > deadline:
                return samples
            previous = samples
            time.sleep(1.0)


def parse_prometheus(text: str, prefix: str = "") -> dict[str, float]:
    """'name{labels} value' lines -> {'name{labels}': value}; comments skipped."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or not line.startswith(prefix):
            continue
        key, _, value = line.rpartition(" ")
        try:
            samples[key] = float(value)
        except ValueError:
            continue
    return samples


def metric_total(samples: dict[str, float], name: str) -> float:
    """Sum of a metric over all its label sets (e.g. over model_name/engine labels)."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))
