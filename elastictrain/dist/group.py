"""The process group of this worker: its device, the run's store it is built on, the errors recorded there.

Why the process group is built on our own store: under ``torchrun --rdzv-backend=c10d`` the
agent hosts one TCPStore for its whole life and hands every restarted attempt the same
MASTER_ADDR:MASTER_PORT (``TORCHELASTIC_USE_AGENT_STORE=True``). ``init_process_group("env://")``
connects to it and keys the default group as ``default_pg/0/...`` — the same keys in every
attempt (torch's comment "we create a new TCPStore for every retry" no longer holds since the
store is shared). A restarted gloo rank then reads the dead attempt's addresses from the store
and fails in ``connectFullMesh`` with "Connection refused", or waits in the ProcessGroupGloo
constructor for peers that will never come. The restart count cannot key them either: it is each
agent's own count and a membership change does not bump it, so a node that joins and a survivor
would build different keys. The ranks of every rendezvous round agree on a nonce of its own
(``rounds.py``), and the group is built under ``elastictrain/<run id>/round-<nonce>/``.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastictrain.core import determinism
from elastictrain.core.config import DistConfig
from elastictrain.core.errors import (
    ConfigError,
    DistributedSetupError,
    ElastictrainError,
    RepeatedFatalError,
    one_line,
)
from elastictrain.core.excepthook import keep_excepthook_outermost
from elastictrain.dist.rounds import agree_on_round
from elastictrain.launcher.launch_env import LaunchEnv, detect_launch_env

log = logging.getLogger("elastictrain")


@dataclass(frozen=True)
class DistContext:
    """The decided set-up of this worker: pass it around instead of re-reading the environment."""

    env: LaunchEnv
    distributed: bool
    device: torch.device
    backend: str | None
    collective_timeout_s: float
    # The launcher's store namespaced to this run (``elastictrain/<run id>/``): it outlives
    # worker restarts under torchrun (the agent hosts it), so attempts can leave facts for the
    # next one. None when there is no process group.
    run_store: Any = None
    # The nonce every rank of this rendezvous round agreed on (rounds.py); "" without a process group.
    round_id: str = ""

    @property
    def rank(self) -> int:
        return self.env.rank if self.distributed else 0

    @property
    def world_size(self) -> int:
        return self.env.world_size if self.distributed else 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def planned_world_size(cfg: DistConfig, environ: Mapping[str, str] | None = None) -> int:
    """The world size ``setup`` will use, read from the launch environment without building anything."""
    env = detect_launch_env(environ)
    distributed = env.world_size > 1 if cfg.distributed == "auto" else bool(cfg.distributed)
    return env.world_size if distributed else 1


def setup(cfg: DistConfig, environ: Mapping[str, str] | None = None) -> DistContext:
    """Decide distributed or not, the device and backend, and initialise the process group."""
    env = detect_launch_env(environ)
    if cfg.distributed == "auto":
        distributed = env.world_size > 1
    elif cfg.distributed and env.launcher == "none":
        raise DistributedSetupError(
            "dist.distributed=true but no torchrun, SLURM or RANK/WORLD_SIZE variables are set; "
            "launch with torchrun/srun or use dist.distributed=auto"
        )
    else:
        distributed = bool(cfg.distributed)
    device = _choose_device(cfg.device, env.local_rank)
    # Before the first CUDA operation: cuBLAS reads its workspace setting when its handle is made.
    startup_line = determinism.apply(determinism.decide(device, cfg.deterministic, os.environ))
    if startup_line:
        log.info("%s", startup_line)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend, run_store, round_id = None, None, ""
    if distributed:
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        if backend == "nccl" and device.type != "cuda":
            raise ConfigError("dist.backend=nccl needs a CUDA device; use dist.backend=gloo on CPU")
        base = _connect_store(env, cfg)
        run_store = _run_store(env, base)
        round_id = agree_on_round(run_store, env.rank, env.world_size, cfg.init_timeout_s)
        check_no_fatal_error(run_store, env, round_id)
        _init_process_group(env, run_store, round_id, backend, device, cfg)
        env = replace(env, restart_count=_group_restart_count(env.restart_count, device))
        log.info(
            "process group %s up: rank %d of %d, restart %d, round %s, launcher %s",
            backend,
            env.rank,
            env.world_size,
            env.restart_count,
            round_id,
            env.launcher,
        )
    return DistContext(env, distributed, device, backend, cfg.collective_timeout_s, run_store, round_id)


def _group_restart_count(own: int, device: torch.device) -> int:
    """The launcher's restart count of the group: the highest of its agents'. torchrun counts a restart only on the
    agent that saw one of its own workers fail; an agent that restarts because another node rejoined the round (a
    membership change) keeps its count. With two nodes, the node whose worker died may be either one, and what rank 0
    reports (the restarts metric, the run log, goodput's restart time) is the group's."""
    count = torch.tensor([own], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def _choose_device(choice: str, local_rank: int) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        choice = f"cuda:{local_rank}"
    try:
        device = torch.device(choice)
    except RuntimeError:
        raise ConfigError(f"dist.device={choice!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DistributedSetupError(f"dist.device={choice!r} but CUDA is not available here; use dist.device=cpu")
    return device


def _connect_store(env: LaunchEnv, cfg: DistConfig) -> Any:
    store_timeout = timedelta(seconds=cfg.init_timeout_s)
    try:
        if env.uses_agent_store:
            base = dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=store_timeout)
        else:
            base = dist.TCPStore(
                env.master_addr,
                env.master_port,
                env.world_size,
                is_master=env.rank == 0,
                timeout=store_timeout,
                multi_tenant=True,
            )
    except (RuntimeError, OSError) as exc:
        raise DistributedSetupError(
            f"rank {env.rank} cannot reach the rendezvous store at {env.master_addr}:{env.master_port} "
            f"within {cfg.init_timeout_s:g}s ({one_line(exc, 200)}); check MASTER_ADDR/MASTER_PORT "
            "and that the port is free and reachable"
        ) from None
    return base


def _init_process_group(
    env: LaunchEnv, run_store: Any, round_id: str, backend: str, device: torch.device, cfg: DistConfig
) -> None:
    # See the module docstring: keys of their own for every round.
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"round-{round_id}", run_store),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=cfg.collective_timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    keep_excepthook_outermost()  # init_process_group wrapped it: a user error's one line would be lost


FATAL_KEY = "fatal_error"


def _run_store(env: LaunchEnv, base: Any) -> Any:
    """The launcher's store, namespaced to this run: the same keys for every attempt of it."""
    return dist.PrefixStore(f"elastictrain/{env.run_id}/", base)


def _write_fatal_error(run_store: Any, env: LaunchEnv, rank: int, error: ElastictrainError, round_id: str = "") -> None:
    run_store.set(
        FATAL_KEY,
        json.dumps(
            {
                "restart": env.restart_count,
                "round": round_id,
                "rank": rank,
                "exit_code": error.exit_code,
                "kind": type(error).__name__,
            }
        ),
    )


def record_fatal_error(ctx: DistContext | None, error: ElastictrainError) -> None:
    """Leave a non-retryable error in the run's store, so later attempts stop at once instead of repeating it."""
    if ctx is None or ctx.run_store is None:
        return
    try:
        _write_fatal_error(ctx.run_store, ctx.env, ctx.rank, error, ctx.round_id)
    except Exception:  # the store's host may be gone too; the error itself was already logged
        log.debug("could not record the fatal error in the run store", exc_info=True)


def recorded_fatal_error(ctx: DistContext | None) -> dict | None:
    """The error no restart can fix that a rank of this round recorded (``record_fatal_error``), if any."""
    if ctx is None or ctx.run_store is None:
        return None
    try:
        if not ctx.run_store.check([FATAL_KEY]):
            return None
        record = json.loads(ctx.run_store.get(FATAL_KEY))
    except Exception:  # the store's host may be gone with the peer
        return None
    return record if record.get("round") == ctx.round_id else None


def check_no_fatal_error(run_store: Any, env: LaunchEnv, round_id: str = "") -> None:
    """Stop this attempt at once if an earlier one recorded an error that no restart can fix."""
    if not run_store.check([FATAL_KEY]):
        return
    record = json.loads(run_store.get(FATAL_KEY))
    if record.get("round") and round_id:
        this_attempt = record["round"] == round_id
    else:  # an error from before the round was agreed (a config error): the agent's restart count is all there is
        this_attempt = record["restart"] >= env.restart_count
    if this_attempt:
        return  # another rank of this very attempt: it says the error itself
    raise RepeatedFatalError(
        f"restart {env.restart_count} skipped: attempt {record['restart']} stopped on a {record['kind']} that a restart "
        f"cannot fix (its message is above, from rank {record['rank']}); fix it and launch again",
        record["exit_code"],
    )


def stop_repeating(error: ElastictrainError, environ: Mapping[str, str] | None = None) -> None:
    """For an error raised before any process group exists (a config error): under torchrun, raise
    RepeatedFatalError if an earlier attempt already reported it, else record it for the next ones."""
    env = detect_launch_env(environ)
    if not env.uses_agent_store or error.retryable:
        return
    try:
        base = dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=timedelta(seconds=10))
    except (RuntimeError, OSError):
        return  # no store to share it through: every attempt says it itself
    run_store = _run_store(env, base)
    check_no_fatal_error(run_store, env)
    _write_fatal_error(run_store, env, env.rank, error)


def teardown(ctx: DistContext) -> None:
    """Destroy the process group, and let gloo's worker threads go idle before Python exits."""
    if not (ctx.distributed and dist.is_initialized()):
        return
    dist.destroy_process_group()
    if ctx.backend == "gloo":
        # destroy_process_group() does not stop gloo's worker threads: the group lives on in
        # C++ until the process exits. A worker still releasing the last collective's tensors
        # must take the GIL; once the interpreter is finalizing, CPython ends such a thread and
        # its C++ unwind calls std::terminate (seen in a core dump: take_gil -> pthread_exit
        # inside ProcessGroupGloo::AsyncWork::~AsyncWork). That is a SIGABRT at exit — 8 of 60
        # runs of a minimal DDP script on torch 2.13 — and torchrun restarts a finished job.
        # Collecting garbage and releasing the GIL for a moment lets those threads finish first.
        gc.collect()
        time.sleep(0.1)
