"""Expert parallelism on CPU: 2 processes over gloo, the dispatch/combine of ``engine.parallel.ep``
against the single-process general path (fp32 within 1e-4), uneven batches, a rank idle in a step."""

from __future__ import annotations

from tests.engine.parallel.ep_worker import SCHEDULE, spawn


def test_ep_two_ranks_gloo_matches_one_process(tmp_path, small_windows_model_dir) -> None:
    res = spawn(tmp_path, small_windows_model_dir, "gloo")
    for r in res:
        assert r["steps"] == len(SCHEDULE)
        assert r["local_experts"] * 2 == r["experts"]
        assert r["worst_vs_general"] <= 1e-4, r
        assert r["agree"] == r["total"], r
