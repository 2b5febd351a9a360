"""Shared fixtures for kvstore tests: a fresh metrics registry and small records.

``redis_server`` comes from the ``tests.conftest_redis`` plugin that tests/conftest.py registers.
"""

from __future__ import annotations

import secrets

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvstore.metrics import KVStoreMetrics
from kvstore.record import RecordHeader, encode_record


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> KVStoreMetrics:
    return KVStoreMetrics(registry)


@pytest.fixture
def prefix() -> str:
    """A Redis key prefix of this test alone (tests share one server)."""
    return f"test:{secrets.token_hex(4)}"


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """Current value of a metric sample (0.0 when absent)."""
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def make_tensors(rows: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """A small stand-in for a block record: two layers of bf16 rows plus an fp32 buffer."""
    g = torch.Generator().manual_seed(seed)
    return {
        "L0.kv": torch.randn(rows, 64, generator=g).to(torch.bfloat16),  # (rows, 64)
        "L1.kv": torch.randn(rows, 64, generator=g).to(torch.bfloat16),  # (rows, 64)
        "L1.idx": torch.randn(rows, 16, generator=g),  # (rows, 16)
    }


def make_blob(key: str, rows: int = 4, seed: int = 0, kind: str = "block") -> bytes:
    header = RecordHeader(kind=kind, fingerprint="tiny", dtype="bfloat16", token_start=0, token_end=128, key=key)  # type: ignore[arg-type]
    return encode_record(header, make_tensors(rows, seed))
