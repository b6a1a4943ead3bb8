"""The server of warm restarts, one per node, torchrun agent and environment; and the child it forks per worker.

The server is forked from a first-attempt worker of the node once that worker has imported torch
(and the ``--preload`` modules), and forks a child for every client that connects. The child takes
on the client's streams, environment, directory and arguments and runs the script as ``__main__``:
it is the worker. How the pieces fit: the docstring of warmstart.py.
"""

from __future__ import annotations

import io
import os
import runpy
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

from elastictrain.core.signals import WARM_CHILD_ENV
from elastictrain.launcher.warm_protocol import REQUEST_TIMEOUT_S, peer_uid, receive_message, say, send_message

# ---- the server: one per node, agent and environment ------------------------------------------


@dataclass
class ChildJob:
    """What a forked child needs to become the worker."""

    request: dict
    fds: list[int]
    connection: socket.socket
    server_pid: int


def serve(base: str, lock_fd: int, agent_fd: int) -> ChildJob | None:
    """Fork a child per request until the agent exits; what the children share is imported already.

    Returns None in the server when its agent is gone, and a ChildJob in each forked child.
    """
    me, path = os.getpid(), base + ".sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    umask = os.umask(0o077)
    try:
        listener.bind(f"{path}.{me}")
        listener.listen(64)
        os.replace(f"{path}.{me}", path)
    except OSError as error:  # a path too long for a unix socket (108 bytes), a full disk
        say(f"cannot listen at {path} ({error}); restarts run cold. Set TMPDIR to a short local directory")
        return None
    finally:
        os.umask(umask)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # the first attempt's log may be gone by the next
    children: dict[int, tuple[int, socket.socket]] = {}  # child pidfd -> (pid, connection)
    try:
        while True:
            waiting: list[socket.socket | int] = [listener, agent_fd, *children]
            readable, _, _ = select.select(waiting, [], [])
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
            if cuda_initialized():  # checked before the server was forked too (warmstart.fork_hazard); never fork one
                _reply(connection, {"cold": "it holds a CUDA context, which a forked worker could not use"})
                connection.close()
                for fd in fds:
                    os.close(fd)
                continue
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


def cuda_initialized() -> bool:
    """Whether this process holds a CUDA context (torch imported and CUDA initialised), without importing torch."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _accept(listener: socket.socket) -> tuple[socket.socket, dict, list[int]] | None:
    connection, _ = listener.accept()
    try:
        if peer_uid(connection) != os.getuid():
            raise OSError("another user")
        connection.settimeout(REQUEST_TIMEOUT_S)
        request, fds = receive_message(connection, want_fds=3)
        connection.settimeout(None)
        if request is None or len(fds) != 3:
            raise OSError("incomplete request")
    except (OSError, ValueError):
        connection.close()
        return None
    return connection, request, fds


def _reply(connection: socket.socket, message: dict) -> None:
    try:
        send_message(connection, message)
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
    os.environ[WARM_CHILD_ENV] = str(job.server_pid)  # its parent: the client answers for the agent's exit
    if "random" in sys.modules:
        sys.modules["random"].seed()
    threading.Thread(
        target=_die_with_client, args=(job.connection,), name="elastictrain-warmstart", daemon=True
    ).start()
    say(
        f"started warm, forked from the preloaded interpreter (pid {job.server_pid}) "
        f"{time.time() - request['client_started']:.2f} s after torchrun started this worker"
    )
    run_target(request["module"], request["script"], request["args"], request["cwd"])


def run_target(module: str | None, script: str | None, args: list[str] | tuple[str, ...], cwd: str) -> None:
    """Run the script, or the module, as ``__main__`` with ``args``, as ``python [-m] TARGET ARGS`` would."""
    if module:
        sys.argv = [module, *args]
        sys.path[0] = cwd
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        assert script is not None  # a module or a script: the wrapper's parser requires one
        sys.argv = [script, *args]
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
        raw = open(fd, "rb" if fd == 0 else "wb", buffering=0 if unbuffered and fd else -1, closefd=False)
        stream = io.TextIOWrapper(
            raw,
            encoding=old.encoding,
            errors=old.errors,
            line_buffering=streams["line_buffering"] or name == "stderr",
            write_through=unbuffered and fd != 0,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _die_with_client(connection: socket.socket) -> None:
    try:
        while connection.recv(1):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)
