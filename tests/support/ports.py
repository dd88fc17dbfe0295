"""Ports for the servers tests start: free, and below the range the OS hands out for its own sockets."""

from __future__ import annotations

import random

from deploy.startup import port_in_use

_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_low() -> int:
    """The lowest port the OS picks for a socket bound to port 0 or an outgoing connection (Linux's default
    32768 where the setting cannot be read)."""
    try:
        with open(_EPHEMERAL_RANGE) as stream:
            return int(stream.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(address: str = "127.0.0.1") -> int:
    """A port nothing listens on at `address` now, below the OS's ephemeral range: between the test choosing it
    and its server binding it, no socket the OS numbers itself (an outgoing connection's source port, a gloo
    rank's listener) can take it, as one could take a port the OS had picked."""
    low = min(_ephemeral_low(), 32768)
    for _ in range(500):
        port = random.randrange(max(1024, low - 12000), low)
        if not port_in_use(address, port):  # the server's own check (`deploy.startup.check_port_free`)
            return port
    raise RuntimeError(f"no free port found on {address} below {low}")
