"""Warm restarts: torchrun's restarted workers are forked from an interpreter that has torch imported.

torchrun answers a dead worker by starting the whole worker group again as new processes. Each
one pays for an interpreter, ``import torch`` and ``torch._dynamo`` (which the first optimizer
imports) before it trains: about 2.4 s of a 3 s restart on 2 CPU cores. Put
``-m elastictrain.warmstart`` before the script and that cost is paid once per node and job:

    torchrun --nproc-per-node=2 ... -m elastictrain.warmstart train.py --lr 0.1
    torchrun --nproc-per-node=2 ... -m elastictrain.warmstart -m elastictrain train

How. The process torchrun starts is a thin client: this module, standard library only.

- **First start of a job on a node.** No server exists yet. The client starts one in the
  background, detached in its own session and tied to the torchrun agent: it exits the moment
  the agent does. Then the client becomes the worker itself with ``exec``. So the first attempt
  runs cold, exactly as without this module.
- **Every later start.** The client connects to the server's unix socket and hands over its
  arguments, environment, working directory and standard streams (the file descriptors, over
  SCM_RIGHTS). The server forks a child that takes them on and runs the script as ``__main__``.
- **The client stays.** It is the process torchrun watches. It forwards every signal torchrun
  sends to the child, and exits as the child did: the same code, or the same signal.
- **The child dies with its client.** A thread of the child waits on the connection. When the
  client's end closes (the client SIGKILLed, say), the child kills itself with SIGKILL. So
  killing the process torchrun started does what it did before.

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
import io
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "elastictrain.loop")
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
KEY_ENV_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "LD_", "TORCH_", "CUDA_")
REQUEST_TIMEOUT_S = 10.0
USAGE = ("give the script to run (or -m MODULE) and its arguments after it, "
         "as torchrun would run them: torchrun ... -m elastictrain.warmstart [--preload a,b] train.py ARGS")
HELP = """usage: torchrun ... -m elastictrain.warmstart [--preload a,b] (SCRIPT | -m MODULE) ARGS...

Warm restarts: torchrun's restarted workers are forked from a per-node interpreter that has torch
(and the --preload modules, comma-separated) imported, instead of starting cold. The first start
of each node runs cold; outside torchrun the script runs as if started directly. More: the
docstring of elastictrain/warmstart.py and launch/README.md.
"""


def _say(message: str) -> None:
    try:
        os.write(2, f"elastictrain.warmstart: {message}\n".encode())
    except OSError:
        pass


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

    flags = list(subprocess._args_from_interpreter_flags())
    if getattr(sys.stdout, "write_through", False) and "-u" not in flags:
        flags.append("-u")  # torchrun starts workers with -u
    return flags


def run_cold(target: Target) -> None:
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
    """What the paths of every server of this user and torchrun agent start with (the server's command line names them)."""
    return os.path.join(runtime_dir(), f"elastictrain-warm-{os.getuid()}-{agent_pid}-")


def runtime_dir() -> str:
    """Where sockets go: the user's own runtime directory if the session has one, else the temp directory."""
    return os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()


# ---- the client: what torchrun starts ---------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        job = serve(argv[1], int(argv[2]), int(argv[3]), tuple(filter(None, argv[4].split(","))))
        if job is not None:  # only in a forked child: it is the worker now
            run_child(job)
        return
    if argv[:1] in (["-h"], ["--help"]):
        sys.stdout.write(HELP)
        return
    target = parse(argv)
    if target is None:
        _say(USAGE)
        sys.exit(2)
    if "TORCHELASTIC_RUN_ID" not in os.environ or not hasattr(os, "pidfd_open"):
        run_cold(target)  # not under torchrun (no agent to tie a server to), or no pidfds: plain start
    base = server_base(target, os.getppid())
    connection = _connect(base + ".sock")
    if connection is None:
        _start_server(base, target)
        run_cold(target)
    _run_warm(connection, target)


def _connect(path: str) -> socket.socket | None:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
    except OSError:  # no server yet, or a stale socket of one that died
        connection.close()
        return None
    if _peer_uid(connection) != os.getuid():  # never hand the environment to another user's process
        connection.close()
        _say(f"{path} is served by another user: this start runs cold")
        return None
    return connection


def _peer_uid(connection: socket.socket) -> int:
    _, uid, _ = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


def _start_server(base: str, target: Target) -> None:
    """Start the node's server unless another local rank is starting it; never wait for it."""
    try:
        lock_fd = os.open(base + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as error:
        _say(f"cannot create {base}.lock ({error}): this start runs cold, and so will restarts")
        return
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: another local rank is starting the server, or it is still importing
        os.close(lock_fd)
        _say("this start runs cold: the preloaded interpreter is not ready yet")
        return
    try:
        agent_fd = os.pidfd_open(os.getppid())
    except OSError as error:
        _say(f"cannot watch the torchrun agent ({error}); restarts run cold")
        os.close(lock_fd)
        return
    flags = _interpreter_flags()
    pid = os.fork()
    if pid == 0:  # the client has no threads yet: fork is safe
        try:
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 0)
            os.dup2(devnull, 1)  # stderr stays: a failed preload says so in the job's log
            os.set_inheritable(lock_fd, True)
            os.set_inheritable(agent_fd, True)
            os.execv(sys.executable, [sys.executable, *flags, "-m", "elastictrain.warmstart", "--serve", base,
                                      str(lock_fd), str(agent_fd), ",".join(target.preload)])
        finally:
            os._exit(1)
    os.waitpid(pid, 0)
    os.close(lock_fd)
    os.close(agent_fd)
    _say("this start runs cold; a preloaded interpreter is starting beside it, and restarts fork from it")


def _send(connection: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    body = json.dumps(message).encode()
    payload = struct.pack("!I", len(body)) + body
    if fds:
        socket.send_fds(connection, [payload], fds)
    else:
        connection.sendall(payload)


def _receive(connection: socket.socket, want_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One length-prefixed JSON message (and up to want_fds descriptors); None at end of stream."""
    data, fds = b"", []
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        if want_fds and not fds:
            chunk, fds, _, _ = socket.recv_fds(connection, 65536, want_fds)
        else:
            chunk = connection.recv(65536)
        if not chunk:
            for fd in fds:
                os.close(fd)
            return None, []
        data += chunk
    return json.loads(data[4:]), fds


def _run_warm(connection: socket.socket, target: Target) -> None:
    child = {"pid": None, "pending": []}

    def forward(signum: int, _frame: object) -> None:
        if child["pid"] is None:
            child["pending"].append(signum)
        else:
            try:
                os.kill(child["pid"], signum)
            except ProcessLookupError:
                pass

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    streams = {"line_buffering": bool(getattr(sys.stdout, "line_buffering", False)),
               "write_through": bool(getattr(sys.stdout, "write_through", False))}
    request = {"module": target.module, "script": target.script, "args": list(target.args), "cwd": os.getcwd(),
               "env": dict(os.environ), "streams": streams, "client_started": process_started_unix()}
    try:
        connection.settimeout(REQUEST_TIMEOUT_S)
        _send(connection, request, [0, 1, 2])
        started, _ = _receive(connection)
        connection.settimeout(None)
    except OSError as error:
        started = None
        _say(f"the preloaded interpreter did not answer ({error})")
    if not started:  # nothing runs yet: start cold instead, with the signals back as they were
        connection.close()
        for signum in FORWARDED_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        for signum in child["pending"]:  # torchrun already asked this worker to stop
            os.kill(os.getpid(), signum)
        _say("this start runs cold")
        run_cold(target)
    child["pid"] = started["pid"]
    for signum in child["pending"]:
        os.kill(child["pid"], signum)
    ended, _ = _receive(connection)
    if ended is None:  # the server went away (its agent exited): nobody reads this status
        os._exit(1)
    exit_like(ended["status"])


def process_started_unix(pid: int | str = "self") -> float:
    """When process ``pid`` was created (fork or exec), as a unix time: field 22 of /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat", "rb") as stat_file:
        raw = stat_file.read().decode()
    start_ticks = int(raw[raw.rfind(")") + 2:].split()[19])
    age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age_s


def exit_like(status: int) -> None:
    """End this process as the one with wait status ``status`` ended: the same signal, or the same code."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
        time.sleep(5)  # a signal whose default is not to end the process: end with its shell code
        os._exit(128 + signum)
    os._exit(os.waitstatus_to_exitcode(status))


# ---- the server: one per node, agent and environment ------------------------------------------


@dataclass
class ChildJob:
    """What a forked child needs to become the worker."""

    request: dict
    fds: list[int]
    connection: socket.socket
    server_pid: int


def serve(base: str, lock_fd: int, agent_fd: int, preload: tuple[str, ...]) -> ChildJob | None:
    """Import ``preload``, then fork a child per request until the agent exits.

    Returns None in the server when its agent is gone, and a ChildJob in each forked child.
    """
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - any failure means: no warm restarts, say why
            _say(f"preloading {name} failed ({type(error).__name__}: {error}); restarts run cold")
            return None
    me, path = os.getpid(), base + ".sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    umask = os.umask(0o077)
    try:
        listener.bind(f"{path}.{me}")
        listener.listen(64)
        os.replace(f"{path}.{me}", path)
    except OSError as error:  # a path too long for a unix socket (108 bytes), a full disk
        _say(f"cannot listen at {path} ({error}); restarts run cold. Set TMPDIR to a short local directory")
        return None
    finally:
        os.umask(umask)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # the first attempt's log may be gone by the next
    children: dict[int, tuple[int, socket.socket]] = {}  # child pidfd -> (pid, connection)
    try:
        while True:
            readable, _, _ = select.select([listener, agent_fd, *children], [], [])
            if agent_fd in readable:
                return None
            for fd in readable:
                if fd in children:
                    pid, connection = children.pop(fd)
                    os.close(fd)
                    _, status = os.waitpid(pid, 0)
                    _reply(connection, {"status": status})
                    connection.close()
            if listener not in readable:
                continue
            accepted = _accept(listener)
            if accepted is None:
                continue
            connection, request, fds = accepted
            pid = os.fork()
            if pid == 0:  # the child keeps only its own connection and descriptors
                listener.close()
                for child_fd, (_, held) in children.items():
                    held.close()
                    os.close(child_fd)
                os.close(agent_fd)
                os.close(lock_fd)  # the server's descriptor keeps the lock
                return ChildJob(request, fds, connection, me)
            for fd in fds:
                os.close(fd)
            children[os.pidfd_open(pid)] = (pid, connection)
            _reply(connection, {"pid": pid})
    finally:
        if os.getpid() == me:  # not in a child leaving through here
            for name in (path, base + ".lock"):
                try:
                    os.unlink(name)
                except FileNotFoundError:
                    pass


def _accept(listener: socket.socket) -> tuple[socket.socket, dict, list[int]] | None:
    connection, _ = listener.accept()
    try:
        if _peer_uid(connection) != os.getuid():
            raise OSError("another user")
        connection.settimeout(REQUEST_TIMEOUT_S)
        request, fds = _receive(connection, want_fds=3)
        connection.settimeout(None)
        if request is None or len(fds) != 3:
            raise OSError("incomplete request")
    except (OSError, ValueError):
        connection.close()
        return None
    return connection, request, fds


def _reply(connection: socket.socket, message: dict) -> None:
    try:
        _send(connection, message)
    except OSError:  # the client is gone; its child dies by itself
        pass


# ---- the child: becomes the worker ------------------------------------------------------------


def run_child(job: ChildJob) -> None:
    """Take on the client's streams, environment, directory and arguments, then run the target as __main__."""
    os.setsid()  # its own session, as torchrun gives each worker
    for target_fd, fd in zip((0, 1, 2), job.fds):
        os.dup2(fd, target_fd)
    for fd in job.fds:
        if fd > 2:
            os.close(fd)
    _rebuild_streams(job.request["streams"])
    request = job.request
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "random" in sys.modules:
        sys.modules["random"].seed()
    threading.Thread(target=_die_with_client, args=(job.connection,), name="elastictrain-warmstart", daemon=True).start()
    _say(f"started warm, forked from the preloaded interpreter (pid {job.server_pid}) "
         f"{time.time() - request['client_started']:.2f} s after torchrun started this worker")
    if request["module"]:
        sys.argv = [request["module"], *request["args"]]
        sys.path[0] = request["cwd"]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    else:
        script = request["script"]
        sys.argv = [script, *request["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


def _rebuild_streams(streams: dict) -> None:
    """sys.std* over the new descriptors 0-2, buffered as the client's were (torchrun's -u: not at all)."""
    for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        try:
            old.flush()
        except (OSError, ValueError):
            pass
        unbuffered = streams["write_through"] or name == "stderr"
        raw = io.open(fd, "rb" if fd == 0 else "wb", buffering=0 if unbuffered and fd else -1, closefd=False)
        stream = io.TextIOWrapper(raw, encoding=old.encoding, errors=old.errors,
                                  line_buffering=streams["line_buffering"] or name == "stderr",
                                  write_through=unbuffered and fd != 0)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _die_with_client(connection: socket.socket) -> None:
    try:
        while connection.recv(1):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
