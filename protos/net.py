"""Network facts both ends need, with no torch import (``dapo learner`` uses them before any rank starts)."""

from __future__ import annotations

import socket


def route_source_address(host: str) -> str:
    """This machine's source address for packets to ``host`` (OSError when unresolvable or
    unroutable). A UDP connect sends nothing: the kernel only picks the route and its address."""
    error: OSError = OSError(f"{host} resolves to no address")
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM):
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            try:
                sock.connect(sockaddr)
            except OSError as exc:
                error = exc
                continue
            return sock.getsockname()[0]
    raise error
