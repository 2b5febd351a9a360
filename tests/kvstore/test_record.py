"""Record encode/decode round trips and every kind of damage -> CorruptRecord."""

from __future__ import annotations

import struct

import pytest
import torch

from kvstore.errors import CorruptRecord, KVStoreError
from kvstore.keys import ROOT_KEY
from kvstore.record import FORMAT_VERSION, RecordHeader, decode_record, encode_record

HEADER = RecordHeader(
    kind="snapshot",
    fingerprint="v4-flash:abc",
    dtype="bfloat16",
    token_start=128,
    token_end=300,
    parent="ab" * 16,
    meta={"layers": 2, "note": "ünïcode"},
    key="cd" * 16,
)


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "L0.swa": torch.randn(127, 64, generator=g).to(torch.bfloat16),  # (127, 64)
        "L0.fp32": torch.randn(3, 5, generator=g),  # (3, 5)
        "L0.fp8": torch.randn(7, 8, generator=g).to(torch.float8_e4m3fn),  # (7, 8)
        "pos": torch.arange(10, dtype=torch.int64),  # (10,)
        "scalar": torch.tensor(2.5),  # ()
        "empty": torch.empty(0, 4),  # (0, 4)
        "strided": torch.randn(8, 6, generator=g).t(),  # (6, 8), non-contiguous
        "mask": torch.tensor([True, False, True]),  # (3,)
    }


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].reshape(-1).view(torch.uint8), b[name].reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("copy", [True, False])
def test_round_trip(copy: bool) -> None:
    t = tensors()
    rec = decode_record(encode_record(HEADER, t), copy=copy)
    assert rec.header == HEADER
    assert rec.header.version == FORMAT_VERSION
    assert_same(t, rec.tensors)


def test_decoded_tensors_are_writable_and_independent() -> None:
    blob = encode_record(HEADER, tensors())
    rec = decode_record(blob)
    rec.tensors["pos"][0] = 99
    assert decode_record(blob).tensors["pos"][0] == 0


def test_accepts_bytearray_and_memoryview() -> None:
    blob = encode_record(HEADER, tensors())
    assert decode_record(bytearray(blob)).header == HEADER
    assert decode_record(memoryview(blob)).header == HEADER


def test_block_defaults() -> None:
    h = RecordHeader(kind="block", fingerprint="fp", dtype="bfloat16", token_start=0, token_end=128)
    rec = decode_record(encode_record(h, {}))
    assert rec.header.parent == ROOT_KEY and rec.tensors == {}


@pytest.mark.parametrize("kind,start,end", [("other", 0, 1), ("block", 5, 1), ("block", -1, 3)])
def test_header_validation(kind: str, start: int, end: int) -> None:
    with pytest.raises(ValueError):
        RecordHeader(kind=kind, fingerprint="", dtype="", token_start=start, token_end=end)  # type: ignore[arg-type]


def test_every_single_byte_flip_is_detected() -> None:
    blob = encode_record(HEADER, {"x": torch.arange(6, dtype=torch.int16)})
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x01
        with pytest.raises(CorruptRecord):
            decode_record(bytes(bad))


def test_bit_flip_in_large_payload() -> None:
    blob = bytearray(encode_record(HEADER, tensors()))
    blob[len(blob) // 2] ^= 0x80
    with pytest.raises(CorruptRecord, match="checksum"):
        decode_record(bytes(blob))


@pytest.mark.parametrize("cut", [0, 1, 10, 19, 24, 100, -1, -4, -5])
def test_truncation(cut: int) -> None:
    blob = encode_record(HEADER, tensors())
    with pytest.raises(CorruptRecord):
        decode_record(blob[:cut])


def test_trailing_garbage() -> None:
    with pytest.raises(CorruptRecord):
        decode_record(encode_record(HEADER, tensors()) + b"\0")


def test_bad_magic_and_version() -> None:
    blob = encode_record(HEADER, tensors())
    with pytest.raises(CorruptRecord, match="magic"):
        decode_record(b"XXXX" + blob[4:])
    future = blob[:4] + struct.pack("<H", FORMAT_VERSION + 1) + blob[6:]
    with pytest.raises(CorruptRecord, match="version"):
        decode_record(future)


def test_corrupt_record_is_a_kvstore_error() -> None:
    assert issubclass(CorruptRecord, KVStoreError)
    with pytest.raises(KVStoreError):
        decode_record(b"garbage")
