"""Mooncake-format traces: one JSON object per line.

Fields (as in Mooncake's published traces): ``timestamp`` (ms since the trace start),
``input_length`` and ``output_length`` (tokens), ``hash_ids`` (one int per ``block_size``-token
block of the prompt; equal ids at equal positions mean an equal prefix up to that block's end).
Mooncake uses ``block_size`` 512; ours is a parameter carried beside the rows, never in them.
Optional extra fields that other readers ignore: ``session_id`` and ``turn``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace."""

    timestamp: float  # ms since the trace start
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str | None = None
    turn: int | None = None

    def to_dict(self) -> dict:
        d: dict = {
            "timestamp": int(self.timestamp) if float(self.timestamp).is_integer() else self.timestamp,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }
        if self.session_id is not None:
            d["session_id"] = self.session_id
        if self.turn is not None:
            d["turn"] = self.turn
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TraceRow:
        return cls(
            timestamp=float(d.get("timestamp", 0)),
            input_length=int(d["input_length"]),
            output_length=max(1, int(d["output_length"])),
            hash_ids=tuple(int(h) for h in d.get("hash_ids", ())),
            session_id=None if d.get("session_id") is None else str(d["session_id"]),
            turn=None if d.get("turn") is None else int(d["turn"]),
        )


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRow]:
    """Rows of a JSONL trace, in file order (blank lines skipped)."""
    rows: list[TraceRow] = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rows.append(TraceRow.from_dict(json.loads(line)))
            if limit is not None and len(rows) >= limit:
                break
    return rows


def write_trace(path: str | Path, rows: Iterable[TraceRow]) -> int:
    """Write rows as JSONL; returns the number written."""
    n = 0
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row.to_dict(), separators=(",", ":")) + "\n")
            n += 1
    return n


def iter_blocks(rows: Iterable[TraceRow]) -> Iterator[int]:
    for row in rows:
        yield from row.hash_ids


def trace_stats(rows: list[TraceRow], block_size: int) -> dict:
    """Summary of a trace: counts, mean lengths, duration, and the ideal block reuse ratio
    (fraction of prompt blocks already seen earlier in the trace: an infinite cache's hit rate)."""
    seen: set[int] = set()
    reused = total = 0
    for row in rows:
        prefix = 0  # chained hash of the ids so far: equal exactly when the whole prefix is
        full = row.input_length // block_size
        for h in row.hash_ids[:full]:
            prefix = hash((prefix, h))
            total += 1
            if prefix in seen:
                reused += 1
            else:
                seen.add(prefix)
    n = len(rows)
    return {
        "requests": n,
        "duration_s": (rows[-1].timestamp - rows[0].timestamp) / 1000 if n else 0.0,
        "mean_input": sum(r.input_length for r in rows) / n if n else 0.0,
        "mean_output": sum(r.output_length for r in rows) / n if n else 0.0,
        "ideal_block_reuse": reused / total if total else 0.0,
    }
