"""Whether a server could listen on a host and port now, asked the way that server will bind them, so that an
address it cannot use is refused before the bundle's load and warm-up rather than after.

Each raises `OSError` (`socket.gaierror` for a name that does not resolve) where its server's bind would
fail, and binds without listening, so the port is free again the moment it returns.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket


def uvicorn_binds(host: str, port: int) -> None:
    """uvicorn's: asyncio's `create_server` binds every address `host` resolves to (an empty host: every
    interface, IPv4 and IPv6), each IPv6 one IPv6-only, and fails if any one fails. A name such as
    localhost that resolves to ::1 and 127.0.0.1 needs both; its first address alone is not enough."""

    async def bind() -> None:
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, host=host, port=port,
                                                                start_serving=False)
        server.close()
        await server.wait_closed()

    asyncio.run(bind())


def ray_proxy_binds(host: str, port: int) -> None:
    """Ray Serve's proxy's: one socket, IPv6 for an IPv6 address or a name with no IPv4 address, else IPv4
    (a name's first IPv4 address, where a name like localhost may resolve to ::1 first; an empty host:
    every IPv4 interface)."""
    family = socket.AF_INET6 if _ipv6_only(host) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))


def grpc_binds(host: str, port: int) -> None:
    """grpc's, as near as Python's resolver gets it: grpc resolves `host` with its own resolver and listens
    where any of its addresses binds; this binds the first address Python's resolver gives (grpc's may
    find more: its localhost is ::1 and 127.0.0.1 where /etc/hosts names 127.0.0.1 alone)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)


def _ipv6_only(host: str) -> bool:
    """An IPv6 address (with or without a zone), or a name that resolves to no IPv4 address."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).version == 6
    except ValueError:
        pass
    try:
        socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return True
    return False
