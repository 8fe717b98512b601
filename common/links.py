"""Liveness of a ZeroMQ TCP link across a real network.

Without it, a link that goes dark (a cable, a VPN, a cloud route, a partition) leaves its TCP
connection "established" while the kernel retransmits with exponential backoff: after a 15 s cut
the next retransmission can come 10-25 s after the network is back, and a learner contributes
nothing meanwhile (measured with `python -m ddloco.bench.multihost`). ZMTP heartbeats declare such a
connection dead after ``HEARTBEAT_TIMEOUT_MS`` and ZeroMQ reconnects at once, retrying every
``RECONNECT_IVL_MS`` (no backoff: a restarted broker or shard is found within 0.1 s; an attempt
at a dead address costs a SYN); a connect that hangs is abandoned after ``CONNECT_TIMEOUT_MS``
and tried again. Subscriptions are replayed on the new connection.
"""
from __future__ import annotations

import zmq

HEARTBEAT_IVL_MS = 1_000
HEARTBEAT_TIMEOUT_MS = 4_000
RECONNECT_IVL_MS = 100
CONNECT_TIMEOUT_MS = 3_000


def keep_alive(sock: zmq.Socket) -> zmq.Socket:
    """Heartbeats and prompt reconnection on ``sock`` (either end of a link); returns it."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
    return sock
