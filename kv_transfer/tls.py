"""TLS settings of the KV transport: which PEM files each side presents and trusts.

Plain data (no grpc import), so the cluster configuration can build and check it on a
machine that never moves KV. `grpc_backend` turns it into gRPC credentials; UCX has no
TLS, so a cluster that sets TLS must use the gRPC transport (`ClusterConfig` refuses
the combination).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TLSConfig:
    """PEM files. The receiver presents cert/key; the sender trusts `ca_file` (never the
    system roots: the cluster's own CA signs its receivers) and presents cert/key as its
    own, which the receiver checks only with `require_client_auth` (mutual TLS).

    `server_name`: the name the receivers' certificate holds, when it is not the address
    the sender dials (e.g. every decode pod presents one certificate for a fixed DNS
    name while announcing its pod IP).
    """

    cert_file: str
    key_file: str
    ca_file: str
    require_client_auth: bool = False
    server_name: str | None = None

    def check(self) -> None:
        """Raise ValueError unless the files exist, parse, and the key matches the cert.

        Uses the standard library's TLS, so a bad file is reported before any process
        starts rather than as a handshake failure on the first push.
        """
        for what, path in (("cert", self.cert_file), ("key", self.key_file), ("ca", self.ca_file)):
            if not Path(path).is_file():
                raise ValueError(f"kv_tls {what} file {path!r} does not exist or is not a file")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(
                f"kv_tls cert {self.cert_file!r} / key {self.key_file!r} do not load as a "
                f"PEM certificate chain and its private key: {exc}"
            ) from exc
        try:
            context.load_verify_locations(cafile=self.ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"kv_tls ca {self.ca_file!r} is not a PEM CA bundle: {exc}") from exc

    def server_credentials(self) -> Any:
        import grpc

        return grpc.ssl_server_credentials(
            [(_read(self.key_file), _read(self.cert_file))],
            root_certificates=_read(self.ca_file),
            require_client_auth=self.require_client_auth,
        )

    def channel_credentials(self) -> Any:
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file),
            private_key=_read(self.key_file),
            certificate_chain=_read(self.cert_file),
        )


def _read(path: str) -> bytes:
    return Path(path).read_bytes()
