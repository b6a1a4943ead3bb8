"""A node that joins a running job warms its workers' interpreter before it joins.

When a node (re)joins a job that is training, the other nodes stop their workers and a new process
group forms with the newcomer's. Those workers are the node's first: without a warm-restart server
they start cold (an interpreter, ``import torch``), and every other rank waits in the new group
for them. Measured in the two-node chaos job on 2 cores: 2.7 s from the new round to the process
group, the whole job idle, at every rejoin.

So before a ``elastictrain-c10d`` (or ``-etcd-v2``) agent first joins a round, it looks at the
round: when a group is already training (``joins_running_job``) and torchrun starts its workers
through ``-m elastictrain.launcher.warmstart`` (``warmstart_args``, read from torchrun's own
command line), it runs ``warmstart --prepare`` with the workers' arguments (``warm_up``): that
forks the node's warm-restart server as the first worker would have, and the workers the new round
starts are forked from it. The others train on meanwhile: the newcomer is not in the round yet.
A fresh job's first round, a job not started through warmstart, or a failed warm-up join as before.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import NoReturn

log = logging.getLogger("elastictrain")

WARMSTART = "elastictrain.launcher.warmstart"
WARM_UP_WITHIN_S = 120.0  # an interpreter and torch's import on a slow node; past it the node joins cold


def warmstart_args(torchrun_argv: Sequence[str]) -> list[str] | None:
    """The arguments torchrun gives ``-m elastictrain.launcher.warmstart`` (what follows it on torchrun's command
    line), or None when the workers are not started through it (a script, ``--no-python``, ``--run-path``)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()

    def refuse(message: str) -> NoReturn:  # argparse would print its usage and exit the agent
        raise ValueError(message)

    parser.error = refuse  # type: ignore[method-assign]
    try:
        args = parser.parse_args(list(torchrun_argv))
    except (ValueError, SystemExit):  # not torchrun's command line: a launcher called in-process (a test, a program)
        return None
    if not args.module or args.no_python or args.run_path or args.training_script != WARMSTART:
        return None
    return list(args.training_script_args)


def joins_running_job(round_state: object) -> bool:
    """Whether torch's rendezvous state (``_RendezvousState``) is that of a job already training: its round is
    complete and has participants (the first round of a fresh job is still open while its nodes arrive)."""
    return bool(getattr(round_state, "complete", False) and getattr(round_state, "participants", None))


def warm_up(args: Sequence[str], within_s: float = WARM_UP_WITHIN_S) -> bool:
    """Run ``warmstart --prepare ARGS`` as torchrun would run a worker (its interpreter, ``-u``, the environment a
    worker gets that the server's key reads); True once the server is up."""
    command = [os.getenv("PYTHON_EXEC", sys.executable), "-u", "-m", WARMSTART, "--prepare", *args]
    env = {**os.environ, "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}
    try:
        # No pipes: the server it forks keeps the standard streams it inherits, and a pipe would never close.
        done = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, timeout=within_s, check=False)
    except subprocess.TimeoutExpired:
        log.warning("warming this node's workers took over %.0f s: it joins the job cold", within_s)
        return False
    return done.returncode == 0


def warm_before_joining(round_state: object, torchrun_argv: Sequence[str]) -> bool:
    """``warm_up`` when this node is about to join a running job whose workers start through warmstart; True when
    it did."""
    if not joins_running_job(round_state):
        return False
    args = warmstart_args(torchrun_argv)
    return args is not None and warm_up(args)


__all__ = ["joins_running_job", "warm_before_joining", "warm_up", "warmstart_args"]
