"""Tensor parallelism (``--tensor-parallel-size N``): every rank drafts, and the ranks must agree.

How vLLM 0.32 runs a custom_class proposer under tensor parallelism (V1 runner, multiprocessing
executor; read in ``v1/executor/multiproc_executor.py`` and ``v1/worker/gpu_model_runner.py``):

- every rank's worker builds the proposer and, at every step, in lockstep (all ranks get the same
  ``SchedulerOutput``), calls ``propose_draft_token_ids``;
- only the output rank's (TP rank 0's) draft tokens reach the scheduler
  (``MultiprocExecutor.sample_tokens`` / ``take_draft_token_ids`` reply from ``output_rank``),
  and the next step's ``SchedulerOutput`` hands those tokens to every rank;
- every rank then runs the rejection sampler itself, against ITS OWN q (``runner._draft_probs``),
  and appends ITS OWN sampled tokens to its batch (``_update_states`` reads the scheduler's
  ``new_token_ids`` only on pipeline stages that do not sample).

So a rank whose drafts or q differ from rank 0's accepts other tokens, feeds them to its shard
of the target, and the all-reduce then mixes shards of two different sequences: silent
corruption. The ranks agree when drafting is a deterministic function of what every rank sees
alike (contexts, request seeds, code, thread count). The plugin makes it so (adapters.py):
unseeded draft tokens draw from the proposer's own generator, reseeded every step (not torch's
default generator, which vLLM's sampler uses for unseeded requests: a rank that drew a different
count there would sample its target tokens differently), and measured costs (adaptive γ
``cost_model`` without ``cost_ratio``: wall-clock differs per rank) are refused.

It is also checked at every step, because a rank-local failure (an exception in one rank's draft,
an out-of-memory, float differences from a different thread count) breaks it: :func:`agree`
all-gathers, over the TP group's CPU (gloo) group, one small record per rank: a hash of the
step's drafts and q (the q rows at each drafted token and at 64 fixed vocabulary columns, the
bytes, not a rounded sum), of the tree plans, the shim's state, and a hash of the batch contexts.
Unless every rank's draft hash equals rank 0's, every rank drops the step's drafts (the step
decodes plainly: exact, no token lost). Ranks whose contexts differ have already diverged, which
the drop prevents; that is logged as an error and counted (it must stay 0).

Test hooks (never set in serving): ``SPECPLUGIN_TP_FAULT=q_rank1`` perturbs TP rank 1's q (a
rank-local difference, as a different thread count would make), ``SPECPLUGIN_TP_CHECK=off``
skips the agreement (only the context hashes are still compared, to show the divergence), and
``SPECPLUGIN_TP_REPORT_DIR`` makes each rank write its counters to ``rank-R.json`` there.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from vllm_specplugin.logging_utils import get_logger, log_once

logger = get_logger()

FAULT_ENV = "SPECPLUGIN_TP_FAULT"
CHECK_ENV = "SPECPLUGIN_TP_CHECK"
REPORT_ENV = "SPECPLUGIN_TP_REPORT_DIR"
SAMPLE_COLUMNS = 64  # vocabulary columns of q hashed per drafted position, besides the drafted token
REPORT_EVERY = 32  # steps between report writes (and at every disagreement)


class _State:
    """Per-runner agreement state and counters."""

    def __init__(self, group):
        self.group = group  # vLLM's GroupCoordinator of the TP group
        self.rank = int(group.rank_in_group)
        self.world_size = int(group.world_size)
        self.steps = 0
        self.disagreements = 0  # steps whose drafts were dropped because the ranks' drafts differ
        self.context_mismatches = 0  # steps whose ranks held different contexts (must stay 0)
        self.columns = None
        self.check = os.environ.get(CHECK_ENV, "on").strip().lower() != "off"
        from vllm_specplugin.fault_switch import fault_variable

        self.fault = fault_variable(FAULT_ENV) or None
        if self.fault not in (None, "q_rank1"):
            raise ValueError(f"{FAULT_ENV}={self.fault!r}: expected q_rank1")
        self.report_dir = os.environ.get(REPORT_ENV) or None


def group_state(runner):
    """The runner's agreement state, or None without tensor parallelism (cached on the runner)."""
    state = getattr(runner, "_specplugin_tp", None)
    if state is None:
        parallel = getattr(runner.vllm_config, "parallel_config", None)
        spec = getattr(runner, "speculative_config", None)
        if int(getattr(parallel, "tensor_parallel_size", 1)) <= 1 or spec is None or spec.method != "custom_class":
            state = False  # vLLM's own methods are its business
        else:
            from vllm.distributed.parallel_state import get_tp_group

            state = _State(get_tp_group())
            log_once("info", f"specplugin: tensor parallelism ({state.world_size} ranks): every rank drafts; the "
                     "ranks' drafts and q are compared at every step and dropped on all ranks unless equal "
                     "(vllm_specplugin/tensor_parallel.py)")
            if state.fault:
                logger.warning("specplugin: %s=%s is set: TP rank 1's q is perturbed (a test fault)", FAULT_ENV, state.fault)
            if not state.check:
                logger.warning("specplugin: %s=off: the ranks' drafts are NOT compared (a test setting; ranks may "
                               "diverge)", CHECK_ENV)
        runner._specplugin_tp = state
    return state or None


def _digest(*parts: bytes) -> int:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return int.from_bytes(h.digest(), "little", signed=True)


def draft_digest(state: _State, draft_token_ids, probs, req_ids, tree_plans) -> int:
    """Hash of what a rank verifies next step: its drafts, its q (the exact float32 bits at each
    drafted token and at SAMPLE_COLUMNS fixed columns) and its tree plans."""
    import torch

    lengths = np.array([len(d) for d in draft_token_ids], dtype=np.int64)
    tokens = np.array([t for d in draft_token_ids for t in d], dtype=np.int64)
    parts = [lengths.tobytes(), tokens.tobytes(), "\0".join(req_ids).encode()]
    if probs is None:
        parts.append(b"no q")
    elif tokens.size:
        rows = len(draft_token_ids)
        q = probs[:rows]  # [rows, k, V]; zero past each row's draft (the drafter's buffer) and for rows without one
        k, vocab = q.shape[1], q.shape[2]
        if state.columns is None or state.columns.numel() and int(state.columns.max()) >= vocab:
            state.columns = torch.linspace(0, vocab - 1, min(SAMPLE_COLUMNS, vocab)).long()
        drafted = np.zeros((rows, k), dtype=np.int64)
        for row, draft in enumerate(draft_token_ids):
            drafted[row, : len(draft)] = draft
        cols = torch.cat([torch.from_numpy(drafted)[..., None], state.columns.expand(rows, k, -1)], -1)
        parts.append(q.gather(2, cols.to(q.device)).to("cpu").contiguous().numpy().tobytes())  # [rows, k, 1 + 64]
    for rid in sorted(tree_plans or {}):
        tokens_, parents = tree_plans[rid]
        parts.append(f"{rid}:{list(tokens_)}:{list(parents)}".encode())
    return _digest(*parts)


def context_digest(runner) -> int:
    """Hash of each row's context as this rank holds it (request id and tokens)."""
    batch = runner.input_batch
    lengths = batch.num_tokens_no_spec[: batch.num_reqs]
    parts = ["\0".join(batch.req_ids).encode(), np.asarray(lengths, dtype=np.int64).tobytes()]
    parts += [batch.token_ids_cpu[row, : int(n)].tobytes() for row, n in enumerate(lengths)]
    return _digest(*parts)


def perturb_for_fault(state: _State, probs) -> None:
    """SPECPLUGIN_TP_FAULT=q_rank1: rank 1's q, mixed 1% with uniform over its support (still a
    distribution the drafted token can come from, just not the one rank 0 drew from)."""
    if state.fault == "q_rank1" and state.rank == 1 and probs is not None:
        support = (probs > 0).to(probs.dtype)
        counts = support.sum(-1, keepdim=True).clamp_min(1)
        probs.mul_(0.99).add_(0.01 * support / counts)


def agree(runner, state: _State, draft_token_ids):
    """All-gather each rank's (flags, draft hash, context hash); return the drafts to use (the
    same decision on every rank). Called by every rank at every propose_draft_token_ids."""
    import torch
    import torch.distributed as dist

    drafter = getattr(runner, "drafter", None)
    probs = getattr(runner, "_draft_probs", None)
    perturb_for_fault(state, probs)
    req_ids = list(runner.input_batch.req_ids)
    shim_on = bool(getattr(runner, "_specplugin_shim_enabled", True))
    mine = torch.tensor([
        int(shim_on),
        draft_digest(state, draft_token_ids, probs, req_ids, getattr(drafter, "tree_plans", None)),
        context_digest(runner),
    ], dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(state.world_size)]
    dist.all_gather(gathered, mine, group=state.group.cpu_group)
    table = torch.stack(gathered)
    state.steps += 1
    changed = False
    if (table[:, 2] != table[0, 2]).any():
        state.context_mismatches += 1
        changed = True
        if state.context_mismatches <= 10 or state.context_mismatches % 100 == 0:
            logger.error("specplugin: TP rank %d holds other contexts than rank 0 (%d step(s) so far): the ranks "
                         "have diverged", state.rank, state.context_mismatches)
    if state.check:
        if shim_on and not bool(table[:, 0].all()):
            # Another rank switched its runner shim off (hand-over failures): all ranks follow,
            # or their drafts differ at every step from now on.
            runner._specplugin_shim_enabled = False
            logger.error("specplugin: another TP rank switched its runner shim off; this rank (%d) follows", state.rank)
        if (table[:, 1] != table[0, 1]).any():
            state.disagreements += 1
            changed = True
            if state.disagreements <= 10 or state.disagreements % 100 == 0:
                logger.warning("specplugin: the TP ranks' drafts or q differ (%d step(s) so far, %d steps checked); "
                               "this step decodes without drafts on every rank", state.disagreements, state.steps)
            runner._draft_probs = None
            runner._draft_prob_req_ids = None
            if drafter is not None and hasattr(drafter, "tree_plans"):
                drafter.tree_plans = {}
            draft_token_ids = [[] for _ in draft_token_ids]
    if state.report_dir and (changed or state.steps % REPORT_EVERY == 1):
        write_report(state)
    return draft_token_ids


def write_report(state: _State) -> None:
    path = os.path.join(state.report_dir, f"rank-{state.rank}.json")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump({"rank": state.rank, "world_size": state.world_size, "steps": state.steps,
                       "disagreements": state.disagreements, "context_mismatches": state.context_mismatches,
                       "check": state.check, "fault": state.fault}, f)
        os.replace(path + ".tmp", path)
    except OSError:
        logger.exception("specplugin: writing the TP report %s failed", path)
