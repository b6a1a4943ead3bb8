"""What the warm-start client (warmstart.py) and its server (warm_server.py) share.

Their messages: length-prefixed JSON over a unix socket, with file descriptors (SCM_RIGHTS), and
only ever to a process of the same user. And their one line on stderr.
"""

from __future__ import annotations

import json
import os
import socket
import struct

REQUEST_TIMEOUT_S = 10.0


def say(message: str) -> None:
    """One line on stderr, as ``elastictrain.launcher.warmstart: MESSAGE``; never raises."""
    try:
        os.write(2, f"elastictrain.launcher.warmstart: {message}\n".encode())
    except OSError:
        pass


def send_message(connection: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    """One length-prefixed JSON message, and ``fds`` with it (SCM_RIGHTS) when given."""
    body = json.dumps(message).encode()
    payload = struct.pack("!I", len(body)) + body
    if fds:
        socket.send_fds(connection, [payload], fds)
    else:
        connection.sendall(payload)


def receive_message(connection: socket.socket, want_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One length-prefixed JSON message (and up to want_fds descriptors); None at end of stream."""
    data, fds = b"", list[int]()
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


def peer_uid(connection: socket.socket) -> int:
    """The user id of the process at the other end of a unix socket."""
    _, uid, _ = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid
