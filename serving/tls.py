"""TLS for every specdec connection: config values in, gRPC credentials out (docs/deploy.md, "Security").

The one place that turns certificate paths into `grpc.ssl_server_credentials` (ServiceHost), the
gateway's HTTPS context (`ServerTLS.ssl_context`) and `grpc.ssl_channel_credentials` (the gateway's
channels to verifier and drafter, `specdec generate`).
The paths are checked when the config is read (`core.config.check_security_keys`); here they are
read when a server starts or a channel opens.
"""

from __future__ import annotations

import ipaddress
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


@dataclass(frozen=True)
class ServerTLS:
    """A server's certificate chain and key (PEM paths); `client_ca` set: mTLS, clients must present a
    certificate that CA signed."""

    cert: str
    key: str
    client_ca: str | None = None

    @classmethod
    def of(cls, section: Any) -> ServerTLS | None:
        """From a config section with `tls_cert`, `tls_key`, `tls_ca` ([gateway], [verifier], [drafter]);
        None (plaintext) when it sets no certificate."""
        if not section.tls_cert:
            return None
        return cls(section.tls_cert, section.tls_key, section.tls_ca)

    def ssl_context(self) -> ssl.SSLContext:
        """The same settings for an HTTPS listener (the gateway's HTTP endpoints)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        if self.client_ca:
            context.load_verify_locations(self.client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))],
            root_certificates=_read(self.client_ca) if self.client_ca else None,
            require_client_auth=self.client_ca is not None,
        )


@dataclass(frozen=True)
class ClientTLS:
    """How a client checks the server (`ca`; None: the system's roots) and, for mTLS, which
    certificate and key it presents."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca) if self.ca else None,
            private_key=_read(self.key) if self.key else None,
            certificate_chain=_read(self.cert) if self.cert else None,
        )


def peer_tls(section: Any) -> ClientTLS | None:
    """The gateway's outgoing TLS ([gateway] tls_peer_ca, tls_client_cert, tls_client_key); None:
    plaintext to verifier and drafter."""
    if not (section.tls_peer_ca or section.tls_client_cert):
        return None
    return ClientTLS(section.tls_peer_ca, section.tls_client_cert, section.tls_client_key)


def open_channel(address: str, tls: ClientTLS | None, options: Sequence[tuple[str, Any]]) -> grpc.Channel:
    """A sync channel to `address`: TLS when `tls` is given, else plaintext."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.credentials(), options=list(options))


def is_loopback(host: str) -> bool:
    """Whether a listen host (as in "host:port") reaches this machine only. "" and "[::]" bind
    every interface; a name other than localhost may resolve anywhere, so it counts as not loopback."""
    host = host.strip("[]")
    if host == "localhost" or host.startswith("unix"):  # a Unix-domain socket never leaves the machine
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read(path: str) -> bytes:
    return Path(path).read_bytes()
