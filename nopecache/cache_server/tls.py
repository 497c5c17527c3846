"""TLS for the gRPC port: server certificate and key, optionally client certificates (mTLS).

::

    tls_cert_file + tls_key_file          TLS: clients verify the server (server-auth only)
    ... + tls_client_ca_file              mutual TLS: every client must present a
                                          certificate that chains to this CA bundle;
                                          the handshake fails otherwise (no RPC runs)

The files are PEM and read once at start-up (restart to rotate). The certificate should
name the address clients dial (a DNS SAN such as ``cache.internal``, or an IP SAN for
``127.0.0.1``), or clients set ``grpc.ssl_target_name_override``. TLS and bearer tokens
are independent: TLS protects the bytes and the token on the wire, the token says which
tenant calls. A client certificate authenticates the connection, not a tenant.

``rediss://`` tier URLs are the Redis side of TLS (see ``tiers/redis.py``).
"""

from __future__ import annotations

from pathlib import Path

import grpc

from nopecache.cache_server.config import ConfigError, ServerConfig

__all__ = ["ServerTls", "load_server_tls", "server_credentials"]


class ServerTls:
    """The PEM material of a TLS-enabled gRPC port (validated for shape, not signature)."""

    __slots__ = ("cert_chain", "client_ca", "private_key")

    def __init__(self, cert_chain: bytes, private_key: bytes, client_ca: bytes | None) -> None:
        _expect_pem(cert_chain, b"CERTIFICATE", "tls_cert_file")
        _expect_pem(private_key, b"PRIVATE KEY", "tls_key_file")
        if client_ca is not None:
            _expect_pem(client_ca, b"CERTIFICATE", "tls_client_ca_file")
        self.cert_chain = cert_chain
        self.private_key = private_key
        self.client_ca = client_ca

    @property
    def mutual(self) -> bool:
        """Whether clients must present a certificate."""
        return self.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        """The grpc server credentials for ``add_secure_port``."""
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


def _expect_pem(data: bytes, label: bytes, option: str) -> None:
    if b"-----BEGIN " not in data or label not in data:
        raise ConfigError(f"{option}: not a PEM file with a {label.decode()} block")


def _read(path: str, option: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{option}: cannot read {path}: {e.strerror}") from e


def load_server_tls(config: ServerConfig) -> ServerTls | None:
    """The TLS material ``config`` names, or None when TLS is off."""
    if not config.tls_enabled:
        return None
    client_ca = (
        _read(config.tls_client_ca_file, "tls_client_ca_file")
        if config.tls_client_ca_file
        else None
    )
    return ServerTls(
        _read(config.tls_cert_file, "tls_cert_file"),
        _read(config.tls_key_file, "tls_key_file"),
        client_ca,
    )


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """Server credentials for ``config``'s TLS options, or None for a plaintext port."""
    tls = load_server_tls(config)
    return tls.credentials() if tls is not None else None
