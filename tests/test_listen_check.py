"""`cosyvoice_serve.listen_check`: the start-up probes for uvicorn and Ray Serve's proxy say what their own
binds then do (grpc's, the first address, is `tests/test_serve.py`'s)."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")

import uvicorn
from fastapi import FastAPI

from cosyvoice_serve import Engine
from cosyvoice_serve import cli as serve_cli
from cosyvoice_serve.listen_check import _ipv6_only, ray_proxy_binds, uvicorn_binds

HOSTS = ["127.0.0.1", "::1", "0.0.0.0", "::", "", "localhost"]
HELD = [None, "127.0.0.1", "::1", "0.0.0.0", "::"]
"""Addresses another process listens on, the port being the one asked for (IPv6 ones IPv6-only)."""


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(not ipv6_loopback(), reason="this machine has no IPv6 loopback to bind")


@contextmanager
def held(address: str | None) -> Iterator[int]:
    """A port free on every address of both families, listened on at `address` (None: nowhere)."""
    with socket.socket(socket.AF_INET6) as dual:  # IPv6 and IPv4 wildcards at once: free on both
        dual.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        dual.bind(("::", 0))
        port = dual.getsockname()[1]
    if address is None:
        yield port
        return
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family) as other:
        if family == socket.AF_INET6:
            other.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        other.bind((address, port))
        other.listen()
        yield port


def binds(probe: Callable[[str, int], None], host: str, port: int) -> bool:
    try:
        probe(host, port)
    except OSError:
        return False
    return True


class StartsAndStops(uvicorn.Server):
    """uvicorn's server, stopping as soon as it has started (or failed to)."""

    async def main_loop(self) -> None:
        return None


def uvicorn_starts(host: str, port: int) -> bool:
    config = uvicorn.Config(FastAPI(), host=host, port=port, lifespan="off", log_level="critical")
    server = StartsAndStops(config)
    try:
        server.run()
    except SystemExit:  # uvicorn's exit where its bind failed
        return False
    return server.started


@needs_ipv6
@pytest.mark.parametrize("other", HELD)
def test_the_http_probe_says_what_uvicorn_does(other: str | None) -> None:
    """Every address a host resolves to, each IPv6 one IPv6-only: an empty host's two wildcards, and `::`
    beside another process's IPv4 wildcard, where a dual-stack probe of `::` alone would refuse a start
    uvicorn makes."""
    verdicts = {}
    for host in HOSTS:
        with held(other) as port:
            verdicts[host] = (binds(uvicorn_binds, host, port), uvicorn_starts(host, port))
    assert {host: probe for host, (probe, _) in verdicts.items()} == \
        {host: started for host, (_, started) in verdicts.items()}, verdicts
    if other is None:  # every host is free: an empty one means every interface, as uvicorn takes it
        assert all(probe for probe, _ in verdicts.values()), verdicts


def resolve_both_loopbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name that resolves to ::1, then 127.0.0.1, as localhost does where /etc/hosts gives it both (Debian,
    Fedora, Docker's containers); this machine's resolver is not ours to configure."""
    resolve = socket.getaddrinfo

    def both(host: str | None, port: int | None, *args: Any, **kwargs: Any) -> list[Any]:
        if host != "both-loopbacks.test":
            return resolve(host, port, *args, **kwargs)
        return resolve("::1", port, *args, **kwargs) + resolve("127.0.0.1", port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", both)


@needs_ipv6
def test_a_name_is_bound_at_every_address_it_resolves_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn binds both of such a name's addresses, so the probe does: ::1 alone, its first, is free."""
    resolve_both_loopbacks(monkeypatch)
    with held("127.0.0.1") as port:
        taken = rf"bind on address \('127\.0\.0\.1', {port}\): address already in use"
        with pytest.raises(OSError, match=taken):
            uvicorn_binds("both-loopbacks.test", port)
        assert not uvicorn_starts("both-loopbacks.test", port)
    with held("::1") as port:
        assert not binds(uvicorn_binds, "both-loopbacks.test", port)
    with held(None) as port:
        assert binds(uvicorn_binds, "both-loopbacks.test", port)


@needs_ipv6
def test_the_ray_probe_binds_one_socket_of_the_hosts_family() -> None:
    """Ray Serve's proxy binds one socket, IPv4 for a name or an IPv4 address: localhost is 127.0.0.1 to it
    whatever else the name resolves to; `::` is dual-stack there, so another's IPv4 wildcard blocks it."""
    with held("127.0.0.1") as port:
        assert not binds(ray_proxy_binds, "localhost", port)
        assert binds(ray_proxy_binds, "::1", port)
    with held("0.0.0.0") as port:
        assert not binds(ray_proxy_binds, "::", port)
        assert not binds(ray_proxy_binds, "", port)  # every IPv4 interface
        assert binds(ray_proxy_binds, "::1", port)
    with held("::") as port:
        assert binds(ray_proxy_binds, "0.0.0.0", port)
        assert not binds(ray_proxy_binds, "::", port)


@pytest.mark.parametrize("host", ["::1", "::", "fe80::1%lo", "127.0.0.1", "0.0.0.0", "localhost", ""])
def test_the_ray_probes_family_is_rays(host: str) -> None:
    """Ray's own test of a host (its proxy's socket family), where Ray is installed."""
    network = pytest.importorskip("ray._common.network_utils", reason="Ray is not installed (the ray extra)")
    assert _ipv6_only(host) == network.is_ipv6(host)


class Opened(Exception):
    """The bundle began to open: the start-up's checks passed."""


@needs_ipv6
@pytest.mark.parametrize(("host", "other", "refused"), [("both-loopbacks.test", "127.0.0.1", True),
                                                        ("::", "0.0.0.0", False), ("", None, False)])
def test_cosyvoice_serve_checks_its_port_as_uvicorn_binds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], host: str,
        other: str | None, refused: bool) -> None:
    """Refused in one line before the bundle opens where uvicorn would fail, let through where not."""
    resolve_both_loopbacks(monkeypatch)

    def opened(*_: object, **__: object) -> None:
        raise Opened

    monkeypatch.setattr(Engine, "open", opened)
    with held(other) as port:
        monkeypatch.setattr(sys, "argv", ["cosyvoice-serve", "--speakers", str(tmp_path / "speakers"),
                                          "--host", host, "--port", str(port)])
        if not refused:
            with pytest.raises(Opened):
                serve_cli.main()
            return
        with pytest.raises(SystemExit) as exit_:
            serve_cli.main()
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    where = f"cannot listen on {host!r} port {port} (--host or $COSYVOICE_HOST, --port)"
    why = f"error while attempting to bind on address ('127.0.0.1', {port}): address already in use"
    assert lines == [f"error: {where}: {why}"], lines
