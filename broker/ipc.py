"""The broker's ipc:// endpoints: a broker and its members on one host, over Unix sockets.

libzmq binds ``ipc://PATH`` by first unlinking whatever is at PATH: a second broker given the
path of a live one silently takes it over, and a regular file there is deleted (tcp:// refuses
both: the port is in use). ``bind_problem`` refuses those before the bind; ``restrict`` then
leaves the bound socket file to this user alone (a connect needs write permission on it).

What that gives: without CURVE (``--insecure``) the file's permission is the only gate, where a
loopback port is open to every user of the host. With CURVE the keys gate every member as on
tcp:// (the broker's role checks need the key's name); the encryption buys little on one host,
where the kernel carries the bytes. An abstract address (``ipc://@NAME``, Linux) has no file: any
process of the host's network namespace reaches it, like a loopback port.
"""
from __future__ import annotations

import errno
import os
import socket
import stat

SOCKET_MODE = 0o600
"""The bound socket file's permission: read and write for its owner only."""


def ipc_path(endpoint: str) -> str | None:
    """The file of an ``ipc://PATH`` endpoint; None for another transport, an abstract address
    (``ipc://@NAME``) or the wildcard (``ipc://*``, a fresh path libzmq picks)."""
    transport, _, address = endpoint.partition("://")
    if transport != "ipc" or address.startswith("@") or address == "*":
        return None
    return address


def bind_problem(endpoint: str) -> str:
    """Why binding ``endpoint`` would not be a fresh, private socket; "" when it is one (or it is
    not an ipc path). Checked just before the bind: a process that binds the path in between is
    not seen."""
    path = ipc_path(endpoint)
    if path is None:
        return ""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"its directory {folder} does not exist (create it with mode 700: only you can reach the socket)"
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return ""
    except OSError as e:
        return f"cannot be checked ({e.strerror})"
    if not stat.S_ISSOCK(mode):
        return "a file that is not a socket is there (binding would delete it)"
    if _listening(path):
        return "a live process listens there (another broker?): stop it or choose another path"
    return ""   # the socket of a stopped process: the bind replaces it


def _listening(path: str) -> bool:
    """Whether a process accepts connections on the Unix socket ``path`` (one it does not let us
    reach counts as in use)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError as e:
            return e.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    return True


def restrict(endpoint: str) -> None:
    """Once ``endpoint`` is bound: its socket file gets ``SOCKET_MODE`` (libzmq made it with the
    process's umask: commonly 755, or 775 where the umask lets the group write)."""
    path = ipc_path(endpoint)
    if path is not None:
        os.chmod(path, SOCKET_MODE)
