"""gRPC credentials from the TLS configs: one place that reads PEM files and picks secure or plain.

Both services listen through `add_port` and the scheduler dials its worker through
`open_channel`, so "no TLS config" always means plaintext and nothing else changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc

from common.config import TlsClientConfig, TlsConfig

ChannelOptions = Sequence[tuple[str, int | str]]


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def tls_mode(tls: TlsConfig | None) -> str:
    """For logs: "off", "tls" or "mutual"."""
    if tls is None:
        return "off"
    return "mutual" if tls.client_ca is not None else "tls"


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """TLS with the service's certificate; with client_ca, only clients it signed get through."""
    client_ca = _read(tls.client_ca)
    return grpc.ssl_server_credentials(
        [(Path(tls.key).read_bytes(), Path(tls.cert).read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def add_port(server: grpc.aio.Server, address: str, tls: TlsConfig | None) -> int:
    """Bind `address` (host:port or unix:///path); returns the port, 0 for unix sockets or failure."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(tls))


def channel_credentials(tls: TlsClientConfig) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca), private_key=_read(tls.key), certificate_chain=_read(tls.cert)
    )


def open_channel(address: str, tls: TlsClientConfig | None, options: ChannelOptions = ()) -> grpc.aio.Channel:
    """An aio channel to `address`: plaintext without a TLS config, else verified TLS."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    opts = list(options)
    if tls.server_name is not None:
        # The name the server's certificate must carry (SAN), when it is not the address host.
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=opts)
