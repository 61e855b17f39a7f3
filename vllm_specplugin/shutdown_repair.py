"""Repair of a shutdown race in vLLM 0.32's API server: SIGTERM under load can hang it for good.

On SIGTERM (or SIGINT) the API server calls ``AsyncLLM.shutdown`` from a worker thread
(``entrypoints/launchers/launcher.py``: ``handle_shutdown``), then asks uvicorn to shut down,
which waits, without a time limit, for open connections to close. ``AsyncLLM.shutdown`` stops
the engine core (``--shutdown-timeout 0``, the default: abort) and then *cancels* the output
handler task. In-flight requests learn that the engine is gone only from that task: when it
sees the dead engine first, it puts ``EngineDeadError`` in every request's queue (clients get
HTTP 500, or an error event in their stream) and the server exits in about a second; when it
is cancelled first, nothing ever completes those requests, their handlers wait forever, and so
does uvicorn ("Waiting for connections to close"): the process never exits and its clients hang
until their own timeouts. Seen here in one of two SIGTERM-under-load runs
(tests/server/test_http_runtime_faults.py::test_sigterm_under_load_shuts_down_cleanly).

The repair wraps ``AsyncLLM.shutdown``: after the original, every request still unfinished gets
``EngineDeadError`` in its queue, on the event loop that owns the queues. Requests that finished
are untouched; with nothing in flight it does nothing. Version-guarded (vLLM 0.32.x) and listed
in ``compat.py``; it must run in the API server process (the plugin's ``register()`` does).
"""

from __future__ import annotations

import functools

from vllm_specplugin import version
from vllm_specplugin.logging_utils import get_logger, log_once

_MARK = "_specplugin_shutdown_repair"


def apply() -> bool:
    """Wrap ``AsyncLLM.shutdown`` on the tested vLLM series. True if it wrapped it now."""
    if not version.is_tested_version():
        return False
    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.shutdown
    if getattr(original, _MARK, False):
        return False
    wrapper = functools.wraps(original)(_failing_unfinished_requests(original))
    setattr(wrapper, _MARK, True)
    AsyncLLM.shutdown = wrapper
    return True


def _failing_unfinished_requests(original):
    def shutdown(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            fail_unfinished_requests(self)

    return shutdown


def fail_unfinished_requests(engine) -> int:
    """Put EngineDeadError in the queue of every request ``engine`` still has in flight; returns
    how many. Never raises (it runs during shutdown)."""
    try:
        processor = getattr(engine, "output_processor", None)
        if processor is None:
            return 0
        pending = processor.get_num_unfinished_requests()
        if not pending:
            return 0
        from vllm.v1.engine.exceptions import EngineDeadError

        error = EngineDeadError()
        handler = getattr(engine, "output_handler", None)
        loop = handler.get_loop() if handler is not None else None
        if loop is not None and not loop.is_closed():
            # The queues' asyncio events belong to the server's loop; shutdown runs in a thread.
            loop.call_soon_threadsafe(processor.propagate_error, error)
        else:
            processor.propagate_error(error)
        log_once("warning", "specplugin: the engine shut down with requests in flight; they end with "
                            "EngineDeadError (clients see an error) instead of waiting forever (vLLM 0.32 "
                            "shutdown race, vllm_specplugin/shutdown_repair.py).")
        return pending
    except Exception:  # noqa: BLE001 - never in the way of a shutdown
        get_logger().exception("specplugin: failing the unfinished requests at shutdown failed")
        return 0
