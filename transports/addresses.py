"""The address a TCP rank listens on.

``options["addr"]``, else the interface ``options["ifname"]`` /
``COLLECTIVES_SOCKET_IFNAME`` (like ``GLOO_SOCKET_IFNAME``), else the local
address that routes to ``MASTER_ADDR``.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from typing import Any

from collectives import config
from collectives.errors import BadArgument

__all__ = ["choose_address"]


def _interface_address(ifname: str) -> str:
    """The IPv4 address of interface ``ifname``."""
    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError as exc:
            raise BadArgument(f"network interface {ifname!r} has no IPv4 address here: {exc}") from exc
    return socket.inet_ntoa(packed[20:24])


def _route_to(host: str) -> str:
    """The local address the kernel would use to reach ``host``."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return s.getsockname()[0]
    except OSError as exc:
        raise BadArgument(f"no route to MASTER_ADDR {host!r}: {exc}") from exc


def choose_address(options: dict[str, Any]) -> str:
    """The address this rank listens on (see the module docstring)."""
    if options.get("addr"):
        return str(options["addr"])
    ifname = config.option(options, "ifname", "SOCKET_IFNAME")
    if ifname:
        return _interface_address(str(ifname))
    return _route_to(str(options.get("master_addr") or os.environ.get("MASTER_ADDR") or "127.0.0.1"))
