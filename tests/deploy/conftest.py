"""Fixtures of the deployment tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import trustme

# tests/deploy/test_cluster.py: its clusters in the order they start, and the tests that
# must end their cluster's turn (they kill one of its workers).
CLUSTER_ORDER = ("colocated", "disagg-grpc", "disagg-ucx")
ENDS_ITS_CLUSTER = ("test_a_removed_worker_leaves_placement_within_its_lease",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each cluster of test_cluster.py serves all its tests in one start.

    Tests that pin one cluster (`parametrize("cluster", [...], indirect=True)`) break
    pytest's grouping of the module-scoped parametrized fixture: it started the clusters
    seven times for three clusters (~30 s a start). Here the module's tests are ordered
    by cluster, then the worker-killing tests last, then as written (the colocated
    cluster first: its answers are the others' logprob reference).
    """
    slots = [
        i
        for i, item in enumerate(items)
        if item.path.name == "test_cluster.py" and item.path.parent.name == "deploy"
    ]

    def key(i: int) -> tuple[int, bool, int]:
        item = items[i]
        callspec = getattr(item, "callspec", None)
        cluster = callspec.params.get("cluster") if callspec is not None else None
        order = CLUSTER_ORDER.index(cluster) if cluster in CLUSTER_ORDER else -1
        name = getattr(item, "originalname", item.name)
        return order, name in ENDS_ITS_CLUSTER, i

    ordered = [items[i] for i in sorted(slots, key=key)]
    for slot, item in zip(slots, ordered, strict=True):
        items[slot] = item


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
