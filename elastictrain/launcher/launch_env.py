"""What the launcher told this process: rank, world size and store address, read once from the environment.

Rank and world size are decided here once; nothing else reads RANK or SLURM_* variables.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from elastictrain.core.errors import DistributedSetupError

# The port a SLURM job's workers (and template (c)'s rendezvous) use on the head node, derived from the
# job id so that two jobs sharing a node do not clash: 12000-27999, below Linux's ephemeral range
# (32768-60999 by default), where the kernel picks ports for outgoing connections, and below torchrun's
# defaults 29400 and 29500. launch/slurm/multi_node_torchrun.sbatch repeats the arithmetic in bash.
SLURM_PORT_BASE = 12000
SLURM_PORT_SPAN = 16000


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process, read once from the environment."""

    launcher: str  # "torchrun", "slurm", "env" (RANK/WORLD_SIZE set by hand) or "none"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    restart_count: int = 0
    run_id: str = "local"
    uses_agent_store: bool = False
    node_rank: int = 0  # GROUP_RANK under torchrun, SLURM_NODEID under srun
    max_restarts: int = 0  # torchrun's --max-restarts: how many times new processes take over from these


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """torchrun variables win over SLURM ones (torchrun inside srun); plain RANK/WORLD_SIZE last."""
    env = os.environ if environ is None else environ
    try:
        if "TORCHELASTIC_RUN_ID" in env or "TORCHELASTIC_RESTART_COUNT" in env:
            return LaunchEnv(
                launcher="torchrun",
                rank=int(env["RANK"]),
                local_rank=int(env["LOCAL_RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                master_addr=env["MASTER_ADDR"],
                master_port=int(env["MASTER_PORT"]),
                restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                run_id=env.get("TORCHELASTIC_RUN_ID", "none"),
                uses_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                node_rank=int(env.get("GROUP_RANK", "0")),
                max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")),
            )
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            job_id = env.get("SLURM_JOB_ID", "0")
            return LaunchEnv(
                launcher="slurm",
                rank=int(env["SLURM_PROCID"]),
                local_rank=int(env.get("SLURM_LOCALID", "0")),
                world_size=int(env["SLURM_NTASKS"]),
                master_addr=env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")),
                # A port derived from the job id lets two jobs share a head node without clashing.
                master_port=int(env.get("MASTER_PORT") or slurm_job_port(int(job_id))),
                restart_count=int(env.get("SLURM_RESTART_COUNT", "0")),
                run_id=f"slurm-{job_id}",
                node_rank=int(env.get("SLURM_NODEID", "0")),
            )
        if "RANK" in env and "WORLD_SIZE" in env:
            return LaunchEnv(
                launcher="env",
                rank=int(env["RANK"]),
                local_rank=int(env.get("LOCAL_RANK", "0")),
                world_size=int(env["WORLD_SIZE"]),
                master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                master_port=int(env.get("MASTER_PORT", "29500")),
            )
    except (KeyError, ValueError) as exc:
        raise DistributedSetupError(
            f"incomplete launch environment: {type(exc).__name__} {exc}; launch with torchrun or srun, "
            "or set dist.distributed=false to train in this one process"
        ) from None
    return LaunchEnv(launcher="none")


def slurm_job_port(job_id: int) -> int:
    """The head node's port for SLURM job ``job_id``: SLURM_PORT_BASE + job_id mod SLURM_PORT_SPAN."""
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[07-09,12],cpu1' -> 'gpu07'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        return nodelist
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


IN_PROCESS_PROTOCOLS = ("memory",)  # fsspec filesystems whose files live in the process that wrote them


def store_lost_on_restart(url: str, env: LaunchEnv) -> str | None:
    """Why snapshots at ``url`` cannot carry this launch's restarts (one line), or None when they can.

    A restart is new processes: a store inside the process is empty in each of them, so every
    restart would start fresh. A single process may keep one (nothing restarts it).
    """
    protocols = [part.partition("://")[0].lower() for part in url.split("::") if "://" in part]
    in_process = next((p for p in protocols if p in IN_PROCESS_PROTOCOLS), None)
    if in_process is None or env.max_restarts == 0:
        return None
    return (
        f"snapshot.durable.url={url} lives in this process's memory, and {env.launcher} restarts the workers as new "
        f"processes (--max-restarts={env.max_restarts}): every restart would find no snapshot and start fresh; "
        "use a path or a store every restart can read (a shared directory, s3://...), or --max-restarts=0"
    )
