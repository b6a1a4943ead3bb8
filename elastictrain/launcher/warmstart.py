"""Warm restarts: torchrun's restarted workers are forked from an interpreter that has torch imported.

torchrun answers a dead worker by starting the whole worker group again as new processes. Each
one pays for an interpreter, ``import torch`` and ``torch._dynamo`` (which the first optimizer
imports) before it trains: about 2.4 s of a 3 s restart on 2 CPU cores. Put
``-m elastictrain.launcher.warmstart`` before the script and that cost is paid once per node and job:

    torchrun --nproc-per-node=2 ... -m elastictrain.launcher.warmstart train.py --lr 0.1
    torchrun --nproc-per-node=2 ... -m elastictrain.launcher.warmstart -m elastictrain train

How. The process torchrun starts is a thin client: this module and ``warm_client.py``, standard library only.

- **First start of a job on a node.** No server exists yet. Local rank 0 imports what the server
  preloads (torch, torch.distributed, torch._dynamo, elastictrain.train.trainer and ``--preload``), imports
  the worker would make anyway, runs MKL's report probe (``threads.warm_up``), then forks the
  server from itself, detached in its own session and tied to the torchrun agent (it exits the
  moment the agent does), and runs the script itself. The other local ranks ``exec`` the script.
  So the first attempt runs cold, and the server costs it no import of its own. Why local rank 0:
  the probe waits for the wall clock's next second (MKL times its clock over one), a wait rank 0
  pays for its start-up line anyway; in the seed it is paid once.
- **Every later start.** The client connects to the server's unix socket and hands over its
  arguments, environment, working directory and standard streams (the file descriptors, over
  SCM_RIGHTS). The server forks a child that takes them on and runs the script as ``__main__``.
- **The client stays.** It is the process torchrun watches. It forwards every signal torchrun
  sends to the child (a SIGTERM to a stopped child as SIGKILL: it could not act on it), and exits
  as the child did: the same code, or the same signal.
- **The client answers for the agent's exit.** It asks the kernel for a signal when the agent exits
  (``PR_SET_PDEATHSIG``) and sends the child a SIGTERM: a child whose agent was SIGKILLed stops at
  an agreed step with a snapshot, as a worker torchrun started itself does (``core/signals.py``).
- **The child dies with its client.** A thread of the child waits on the connection. When the
  client's end closes (the client SIGKILLed, say), the child kills itself with SIGKILL. So
  killing the process torchrun started does what it did before.

- **A node joining a running job.** The first start of the node's workers would run cold while
  every other node's workers wait in their new process group for them (2.7 s on 2 cores). So the
  ``elastictrain-c10d`` handler of a joining agent runs ``warmstart --prepare`` with the workers'
  arguments before it joins (``join_warmup.py``): it forks the server as a first worker would,
  without running the target, and the node's first workers start warm.

Anything that fails before a child starts falls back to the cold path, with one line on stderr.
What differs from a cold worker: the child shares the server's ``PYTHONHASHSEED`` (string hash
order), and the modules in ``--preload`` were imported with the environment of the first
attempt. A server serves only clients whose interpreter, working directory and start-up
environment (``PYTHON*``, ``OMP_*``, ``MKL_*``, ``KMP_*``, ``LD_*``, ``TORCH_*``, ``CUDA_*``
variables) match its own. Python's ``random`` is reseeded from the OS in every child, as a
fresh interpreter would be.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import NoReturn

from elastictrain.launcher.warm_client import connect, run_warm
from elastictrain.launcher.warm_protocol import say
from elastictrain.launcher.warm_server import ChildJob, cuda_initialized, run_child, run_target, serve

DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "elastictrain.train.trainer")
KEY_ENV_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "LD_", "TORCH_", "CUDA_")
USAGE = (
    "give the script to run (or -m MODULE) and its arguments after it, "
    "as torchrun would run them: torchrun ... -m elastictrain.launcher.warmstart [--preload a,b] train.py ARGS"
)
HELP = """usage: torchrun ... -m elastictrain.launcher.warmstart [--preload a,b] (SCRIPT | -m MODULE) ARGS...

Warm restarts: torchrun's restarted workers are forked from a per-node interpreter that has torch
(and the --preload modules, comma-separated) imported, instead of starting cold. The first start
of each node runs cold; outside torchrun the script runs as if started directly. More: the
docstring of elastictrain/launcher/warmstart.py and launch/README.md.
"""


@dataclass(frozen=True)
class Target:
    """What to run: a script path or a module, its arguments, and what the server imports first."""

    module: str | None
    script: str | None
    args: tuple[str, ...]
    preload: tuple[str, ...]


def parse(argv: list[str]) -> Target | None:
    """``[--preload a,b] (-m MODULE | SCRIPT) ARGS...``; None when no script or module is given."""
    preload = list(DEFAULT_PRELOAD)
    argv = list(argv)
    while argv and argv[0].startswith("--preload"):
        option = argv.pop(0)
        names = option.partition("=")[2] if "=" in option else (argv.pop(0) if argv else "")
        preload += [name for name in names.split(",") if name]
    if argv[:1] == ["-m"]:
        return Target(argv[1], None, tuple(argv[2:]), tuple(preload)) if len(argv) > 1 else None
    if not argv or argv[0].startswith("-"):
        return None
    return Target(None, argv[0], tuple(argv[1:]), tuple(preload))


def _interpreter_flags() -> list[str]:
    import subprocess  # only the cold path needs it

    flags = list(subprocess._args_from_interpreter_flags())  # type: ignore[attr-defined]  # private, not in typeshed
    if getattr(sys.stdout, "write_through", False) and "-u" not in flags:
        flags.append("-u")  # torchrun starts workers with -u
    return flags


def run_cold(target: Target) -> NoReturn:
    """Become the worker: exec the interpreter on the target, as torchrun would have."""
    head = ["-m", target.module] if target.module else [target.script]
    argv = [sys.executable, *_interpreter_flags(), *head, *target.args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)


def server_base(target: Target, agent_pid: int) -> str:
    """Socket and lock paths without suffix: one server per user, agent and start-up environment."""
    environment = sorted((k, v) for k, v in os.environ.items() if k.startswith(KEY_ENV_PREFIXES))
    material = json.dumps([sys.executable, sys.flags[:], os.getcwd(), list(target.preload), environment])
    key = hashlib.sha256(material.encode()).hexdigest()[:12]
    return server_prefix(agent_pid) + key


def server_prefix(agent_pid: int) -> str:
    """What the paths of every server of this user and torchrun agent start with (its socket and lock file)."""
    return os.path.join(runtime_dir(), f"elastictrain-warm-{os.getuid()}-{agent_pid}-")


def runtime_dir() -> str:
    """Where sockets go: the user's own runtime directory if the session has one, else the temp directory."""
    return os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()


# ---- the client: what torchrun starts ---------------------------------------------------------


PREPARE = "--prepare"  # first argument: fork this agent's server and exit, running nothing (join_warmup.py)
SERVER_BOUND_WITHIN_S = 10.0  # how long --prepare waits for the server it forked to bind its socket


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        sys.stdout.write(HELP)
        return
    if argv[:1] == [PREPARE]:
        prepare(argv[1:])
    target = parse(argv)
    if target is None:
        say(USAGE)
        sys.exit(2)
    if "TORCHELASTIC_RUN_ID" not in os.environ or not hasattr(os, "pidfd_open"):
        run_cold(target)  # not under torchrun (no agent to tie a server to), or no pidfds: plain start
    base = server_base(target, os.getppid())
    connection = connect(base + ".sock")
    if connection is not None:  # it returns only if no child started: then this start runs cold
        run_warm(connection, target.module, target.script, target.args)
        run_cold(target)
    if os.environ.get("LOCAL_RANK", "0") != "0":  # local rank 0 forks the server; the others need not wait for it
        say("this start runs cold: local rank 0 forks the preloaded interpreter")
        run_cold(target)
    started = _start_server(base, target)
    if started is None:
        run_cold(target)
    elif started is SERVED:  # the server, once its agent has exited and its files are gone: nothing to flush
        os._exit(0)
    elif isinstance(started, ChildJob):  # a worker the server forked for a later start
        run_child(started)
    else:  # this worker imported what the server preloads and forked the server from itself
        run_target(target.module, target.script, target.args, os.getcwd())


def prepare(argv: list[str]) -> NoReturn:
    """``--prepare``, run by a torchrun agent (its child, as its workers are) before it joins a running job: fork
    the server a first worker would fork, for the workers' arguments ``argv``, and exit 0 once its socket is bound
    (1, with one line, when no server could be started). Runs nothing of the target."""
    target = parse(argv)
    if target is None or not hasattr(os, "pidfd_open"):
        say("--prepare: " + (USAGE if target is None else "no pidfds here: the node's first start runs cold"))
        os._exit(2 if target is None else 1)
    base = server_base(target, os.getppid())
    connection = connect(base + ".sock")
    if connection is not None:  # a server of this agent already answers
        connection.close()
        os._exit(0)
    started = _start_server(base, target, preparing=True)
    if started is SERVED:
        os._exit(0)
    if isinstance(started, ChildJob):  # a worker the server forked later: the target runs there
        run_child(started)
    if started is None or not os.path.exists(base + ".lock"):  # no server: it said why (the lock gone: none forked)
        os._exit(1)
    deadline = time.monotonic() + SERVER_BOUND_WITHIN_S
    while not os.path.exists(base + ".sock") and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if os.path.exists(base + ".sock") else 1)


SERVED = object()  # what _start_server returns in the server once it is done serving
SEEDED = object()  # ... and in the worker that forked the server from itself


def _start_server(base: str, target: Target, preparing: bool = False) -> object:
    """Fork the node's server from this worker once it has imported what the server preloads.

    Returns None when a server of this agent holds the lock but does not answer yet (or it cannot
    be done; one line says why): this worker then starts cold. Otherwise SEEDED in this worker, SERVED in the server when its
    agent has exited, and a ChildJob in each worker the server forks later. The import is one the
    worker pays anyway, so the server costs the first attempt no CPU of its own.
    """
    try:
        lock_fd = os.open(base + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as error:
        say(f"cannot create {base}.lock ({error}): this start runs cold, and so will restarts")
        return None
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: this agent's server is being forked, or has not bound its socket yet
        os.close(lock_fd)
        say("this start runs cold: the preloaded interpreter is not ready yet")
        return None
    try:
        agent_fd = os.pidfd_open(os.getppid())
    except OSError as error:
        say(f"cannot watch the torchrun agent ({error}); restarts run cold")
        os.close(lock_fd)
        return None
    preloaded = preload(target.preload)
    unsafe = fork_hazard(threading.active_count() - 1, cuda_initialized()) if preloaded else None
    if unsafe:
        say(f"{unsafe}; restarts run cold")
    if not preloaded or unsafe:
        os.unlink(base + ".lock")  # no server will own it
        os.close(lock_fd)
        os.close(agent_fd)
        return SEEDED  # what it imported stays imported: the target runs here, as it would have
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()  # detached from the worker's session: torchrun's kill of the worker group misses it
            if os.fork() != 0:
                os._exit(0)
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 0)
            os.dup2(devnull, 1)  # stderr stays until it listens: a failure says so in the job's log
            os.close(devnull)
            os.ftruncate(lock_fd, 0)
            os.pwrite(
                lock_fd, str(os.getpid()).encode(), 0
            )  # who holds the server's name: its pid, for tools (tests/helpers/procs.py)
            job = serve(base, lock_fd, agent_fd)
        except BaseException:  # noqa: BLE001 - never run on as a second copy of the worker; a bug keeps its traceback
            import traceback  # only here: the thin client starts in milliseconds

            traceback.print_exc()
            os._exit(1)
        return SERVED if job is None else job
    os.waitpid(pid, 0)
    os.close(lock_fd)
    os.close(agent_fd)
    say(
        "forked a preloaded interpreter before this node joined the job: its first workers start warm"
        if preparing
        else "this start runs cold and forked a preloaded interpreter from itself: restarts fork from it"
    )
    return SEEDED


def fork_hazard(started_threads: int, cuda_context: bool) -> str | None:
    """Why a fork of this interpreter would give broken workers, or None when it is safe.

    A thread holding a lock at the fork leaves the lock held forever in the child. A CUDA context does not
    survive a fork at all: torch marks the child a "bad fork" and its first CUDA call raises, so every warm
    worker of a GPU job would fail. The preloaded interpreter must never have touched CUDA.
    """
    if cuda_context:
        return "a preloaded module initialised CUDA: a forked worker could not use the GPU"
    if started_threads:
        return f"the preloaded modules started threads ({started_threads}): a fork of them is unsafe"
    return None


def preload(names: tuple[str, ...]) -> bool:
    """Import ``names`` and warm up MKL's report (``threads.warm_up``) here, before the server is forked.

    False, with one line, when an import fails: no server then, and the worker runs on as it would have.
    """
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - any failure means: no warm restarts, say why
            say(f"preloading {name} failed ({type(error).__name__}: {error}); restarts run cold")
            return False
    if "torch" in sys.modules:
        from elastictrain.core.threads import (
            warm_up,  # torch is loaded: the children's first MKL report costs nothing then
        )

        try:
            warm_up()
        except Exception as error:  # noqa: BLE001 - a probe that fails here fails in the child too, and says so there
            say(f"warming up MKL's report failed ({type(error).__name__}: {error})")
    return True


if __name__ == "__main__":
    main()
