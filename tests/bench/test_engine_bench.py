"""``bench.engine_bench`` end to end at toy sizes: ours, the general path, the eager slot decode and transformers'
``generate`` on the same tiny checkpoint, and the memory waves, in one call of its ``main``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import engine_bench


@pytest.mark.slow  # a bench script's smoke run (the engine's parity with transformers is pinned by tests/engine)
def test_engine_bench_smoke(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "engine_bench.json"
    argv = [
        "--output", str(out), "--model", str(tiny_model_dir), "--concurrency", "2", "--prompt-lens", "40",
        "--new-tokens", "6", "--repeats", "1", "--memory-requests", "4", "--memory-concurrency", "2", "--general-path", "--eager-slots",
    ]  # fmt: skip
    assert engine_bench.main(argv) == 0
    report = json.loads(out.read_text())
    rows = report["throughput"]
    assert [(r["prompt_len"], r["concurrency"]) for r in rows] == [(40, 2)]
    for r in rows:
        assert r["same_tokens"] == f"{r['concurrency']}/{r['concurrency']}"  # greedy: the same model as transformers
        assert r["ours_tok_s"] > 0 and r["transformers_tok_s"] > 0 and r["general_path_tok_s"] > 0 and r["eager_slots_tok_s"] > 0
    mem = report["memory"]
    assert mem["requests"] == 4 and len(mem["waves"]) == 2
    assert mem["slot_pool_bytes"] > 0 and mem["slot_pool_slots"] >= 2
