"""Rendezvous ports for the tests' multi-process launches."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port nothing listens on now, picked by the OS: launches from tests running side by side
    (pytest -n 2) never meet on one port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
