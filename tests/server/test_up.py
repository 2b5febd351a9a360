"""``deepserve up``'s supervision of its workers, with real processes.

A worker that exits is started again on its port with a backoff that doubles while it keeps
dying; a real engine worker killed with SIGKILL comes back healthy on the same URL, requiring
the stack's internal token on its internal routes.
"""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from server.up import UpOptions, WorkerSet, http_ok


class _Crashing(WorkerSet):
    """Workers that are a Python process exiting at once with status 3."""

    def command(self, role, port):  # noqa: ANN001
        return [sys.executable, "-c", "import sys; sys.exit(3)"]


def test_a_worker_that_keeps_dying_is_restarted_with_growing_backoff(tmp_path: Path) -> None:
    ws = _Crashing(UpOptions(cache_dir=tmp_path, restart_backoff_s=0.2, shutdown_timeout_s=1), tmp_path)
    ws.start()
    ws.supervise(interval_s=0.02)
    try:
        w = ws.workers[0]
        deadline = time.monotonic() + 10
        while w.restarts < 3:
            assert time.monotonic() < deadline, f"only {w.restarts} restarts"
            time.sleep(0.02)
        assert w.backoff_s == pytest.approx(0.8)  # 0.2, 0.4, 0.8: it died within a minute each time
    finally:
        ws.stop()
    assert not ws.workers


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_engine_worker_comes_back_on_its_port(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("DEEPSERVE_KV_FS_FSYNC", "false")
    opts = UpOptions(cache_dir=tmp_path, model_dir=tiny_model_dir, dtype="float32", restart_backoff_s=0.1,
                     engine_args=("--static-decode", "off", "--kv-cache", "off"))
    ws = WorkerSet(opts, tiny_model_dir)
    ws.start()
    try:
        ws.wait_healthy(120)
        ws.supervise(interval_s=0.1)
        w = ws.workers[0]
        first = w.proc.pid
        w.proc.kill()
        deadline = time.monotonic() + 120
        while not (w.proc.pid != first and http_ok(w.url + "/health")):
            assert time.monotonic() < deadline, "the worker did not come back"
            time.sleep(0.2)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(w.url + "/load", timeout=5)
        assert refused.value.code == 401
        with urllib.request.urlopen(urllib.request.Request(w.url + "/load", headers=ws.auth.headers()), timeout=5) as resp:
            assert resp.status == 200
    finally:
        ws.stop()
