"""Binding a service's TCP ports: one process per port, and a one-line refusal when it is taken.

gRPC binds with SO_REUSEPORT by default, so a second `llmserve up` on a port another one
serves would start without error and the kernel would split the traffic between the two.
Every server of ours turns that off, and checks the port itself first so that the refusal is
our message rather than the gRPC core's log line and a traceback.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable

import grpc

from common.config import TlsConfig
from common.grpc.tls import add_port

# The gRPC server option that stops two processes from sharing one port.
EXCLUSIVE = ("grpc.so_reuseport", 0)


class PortUnavailable(ValueError):
    """A port another process holds, or an address this machine does not have (exit 2)."""


def _host_port(address: str) -> tuple[str, int] | None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "0.0.0.0", int(port)


def check_free(address: str, what: str) -> None:
    """Raise PortUnavailable when `address` (host:port) cannot be listened on; port 0 and
    unix sockets pass. A listening socket of any process makes bind fail even with
    SO_REUSEADDR, which only forgives connections left in TIME_WAIT."""
    parsed = _host_port(address)
    if address.startswith("unix:") or parsed is None or parsed[1] == 0:
        return
    host, port = parsed
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise PortUnavailable(f"{what} {address}: {error.strerror}") from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as error:
                reason = "in use by another process" if error.errno == errno.EADDRINUSE else error.strerror
                raise PortUnavailable(f"{what} {address}: {reason}") from None


def bind(server: grpc.aio.Server, address: str, tls: TlsConfig | None, what: str) -> int:
    """Bind a gRPC server (made with EXCLUSIVE) to host:port or unix:///path; the port bound."""
    check_free(address, what)
    try:
        port = add_port(server, address, tls)
    except RuntimeError:  # taken between the check and the bind
        port = 0
    if port == 0 and not address.startswith("unix:"):
        raise PortUnavailable(f"{what} {address}: cannot listen there")
    return port


def serve_http(start: Callable[[int, str], object], port: int, host: str, what: str) -> None:
    """Start an HTTP endpoint (the metrics) with the same refusal as `bind`."""
    try:
        start(port, host)
    except OSError as error:
        reason = "in use by another process" if error.errno == errno.EADDRINUSE else error.strerror
        raise PortUnavailable(f"{what} {port} on {host}: {reason}") from None
