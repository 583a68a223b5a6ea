"""Fixtures of the deployment tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import trustme


def write_kv_tls(folder: Path) -> list[str]:
    """A fresh CA and a certificate for 127.0.0.1 in `folder`; the --kv-tls-* flags."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    paths = {name: folder / f"{name}.pem" for name in ("cert", "key", "ca")}
    cert.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    ca.cert_pem.write_to_path(str(paths["ca"]))
    return [arg for name, path in paths.items() for arg in (f"--kv-tls-{name}", str(path))]


@pytest.fixture(scope="session")
def kv_tls_flags() -> Callable[[Path], list[str]]:
    """`kv_tls_flags(folder)`: write a CA and a 127.0.0.1 certificate; the flags."""
    return write_kv_tls
