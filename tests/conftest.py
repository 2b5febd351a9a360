"""Shared fixtures: tiny checkpoints made on the spot (once per session)."""

from __future__ import annotations

import fcntl
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # tiny CPU ops: spin-waiting threads cost more than they give (see builder)


def _cache_bytecode_outside_the_tree() -> None:
    """Under ``PYTHONDONTWRITEBYTECODE`` (set on the 2-core test box) every process of the run (both xdist
    workers, each ``deepserve up`` / ``engine`` / child pytest it starts) compiles the project's
    sources and re-rewrites every test module's asserts: ~8 s of each worker's collection and about
    a second of each subprocess start, every run. Keep the tree free of ``__pycache__`` as the
    setting asks, but cache the bytecode under the interpreter's environment (``sys.prefix``) and
    hand the prefix to the subprocesses. A ``PYTHONPYCACHEPREFIX`` already chosen is kept."""
    if not sys.dont_write_bytecode or sys.pycache_prefix:
        return
    prefix = Path(sys.prefix) / "pycache"
    try:
        prefix.mkdir(exist_ok=True)
    except OSError:
        return  # a read-only environment: compile as before
    sys.pycache_prefix, sys.dont_write_bytecode = str(prefix), False
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


_cache_bytecode_outside_the_tree()

pytest_plugins = ["tests.conftest_redis"] if (Path(__file__).parent / "conftest_redis.py").exists() else []


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Path]) -> Path:
    """``build(dir)`` run once for the whole run, shared by every pytest-xdist worker: the first
    worker builds under a lock in the run's common temp root, the others wait and reuse it."""
    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent  # one root per run, above each worker's own
    out, done = root / f"shared-{name}", root / f"shared-{name}.done"
    out.mkdir(exist_ok=True)
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            done.write_text(str(build(out)))
    return Path(done.read_text())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny checkpoint (4 layers: sliding, CSA, HCA(128), CSA; hidden 128), built once
    for the run (tests only read it)."""
    from engine.model.tiny import make_tiny_model

    return built_once(tmp_path_factory, "tiny", lambda d: make_tiny_model(d / "model", seed=0, preset="tiny"))


@pytest.fixture(scope="session")
def small_windows_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint with window 16 and HCA ratio 8, so short runs cross every boundary (built
    once for the run)."""
    from engine.model.tiny import make_tiny_model

    return built_once(tmp_path_factory, "tiny-sw", lambda d: make_tiny_model(d / "model", seed=1, preset="tiny-small-windows"))


@pytest.fixture(scope="session")
def trained_mtp_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with its lm_head and MTP layer fitted to the synthetic language of
    ``engine/model/tiny_mtp.py`` (``make-tiny-model --train-mtp``; ~10 s once per session)."""
    from engine.model.tiny import make_tiny_model
    from engine.model.tiny_mtp import TrainConfig

    return built_once(
        tmp_path_factory, "tiny-mtp",
        lambda d: make_tiny_model(d / "model", seed=0, preset="tiny", train_mtp=TrainConfig(seed=0)),
    )


@pytest.fixture(scope="session")
def trained_dspark_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``tiny-v41`` checkpoint with its lm_head and DSpark draft layers fitted to the synthetic
    language of ``engine/model/tiny_mtp.py`` (``make-tiny-model --preset tiny-v41 --train-mtp``;
    built once per session)."""
    from engine.model.tiny import make_tiny_model
    from engine.model.tiny_mtp import TrainConfig

    return built_once(
        tmp_path_factory, "tiny-v41-dspark",
        lambda d: make_tiny_model(d / "model", seed=0, preset="tiny-v41", train_mtp=TrainConfig(seed=0)),
    )


@pytest.fixture(scope="session")
def narrow_checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``deepserve make-random-checkpoint --preset v4-flash-narrow --layers 4 --device cpu`` (the
    released layout at narrow width: FP8 linears, FP4 experts, every layer kind; 145 MB), written
    through the CLI once for the run and shared by the files that read it (they only read it)."""
    from deepserve.cli import main

    def build(d: Path) -> Path:
        out = d / "ckpt"
        assert main(["make-random-checkpoint", "--preset", "v4-flash-narrow", "--layers", "4", "--out", str(out), "--device", "cpu"]) == 0
        return out

    return built_once(tmp_path_factory, "narrow", build)


# ---- pytest-xdist `--dist loadfile` (make test): scheduling hints, no test changes ----------------
TESTS = Path(__file__).resolve().parent
# Files by their measured share of the suite (seconds summed over setup, call and teardown on the
# 2-core box), heaviest first: handed out first, so no heavy file starts last and sets the wall
# clock alone. Only an ordering hint: a file missing here just goes after them, in collection order.
HEAVY_FIRST = (
    "tests/integration/test_router_real_workers.py",  # 91 s
    "live-stack",  # 80 s: the files on `live_stack`, one scope (below)
    "tests/engine/runtime/test_speculative_v41.py",  # 70 s
    "tests/engine/model/test_parity.py",  # 43 s
    "tests/engine/test_kv_connector.py",  # 35 s
    "tests/engine/runtime/test_speculative.py",  # 35 s
    "tests/engine/test_kv_units_v41.py",  # 34 s
    "tests/server/test_e2e_v41.py",  # 33 s
    "tests/engine/sampling/test_sampling_structured.py",  # 27 s
    "tests/kernels/test_interpret.py",  # 35 s: V4.1's kernels under the Triton interpreter, one child
    # then the files of 10-30 s (their slowest tests, a run on the loaded box), so the run's last
    # hand-outs are files of a few seconds and both workers end together
    "tests/engine/runtime/test_grammar_wait.py",
    "tests/engine/model/test_static_decode.py",
    "tests/engine/model/test_random_checkpoint.py",
    "tests/engine/worker/test_worker_boundary.py",
    "tests/engine/model/v41/test_v41_parity.py",
    "tests/bench/test_fit_validate.py",
    "tests/integration/test_error_paths.py",
    "tests/engine/model/test_static_decode_native.py",
    "tests/server/test_fuzz.py",
    "tests/engine/sampling/test_schema_property.py",
    "tests/engine/worker/test_worker_death.py",
    "tests/engine/model/v41/test_v41_worker.py",
    "tests/engine/runtime/test_speculative_slots.py",
    "tests/server/test_cli.py",
    "tests/engine/parallel/test_ep.py",
)


@functools.cache
def _uses_live_stack(scope: str) -> bool:
    """Whether the test file ``scope`` (a path from the repository root) uses the ``live_stack`` fixture."""
    path = TESTS.parent / scope
    return path.name.startswith("test_") and path.suffix == ".py" and path.is_file() and "live_stack" in path.read_text(errors="ignore")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under ``--dist loadfile``: the files that use the session-scoped ``live_stack`` (a
    ``deepserve up`` subprocess, ~17 s to start on this box) form one work unit, so one worker
    starts it once, as a run without xdist does, instead of every worker that gets one of them;
    and the heaviest files go out first (``HEAVY_FIRST``).
    Any other ``--dist``: xdist's own."""
    if getattr(config.option, "dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    rank = {scope: i for i, scope in enumerate(HEAVY_FIRST)}

    class SharedStackFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "live-stack" if _uses_live_stack(scope) else scope

        ordered = False

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # the first hand-out: the queue is complete, in collection order
                self.ordered = True
                units = sorted(self.workqueue.items(), key=lambda unit: rank.get(unit[0], len(rank)))  # stable
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

    return SharedStackFileScheduling(config, log)
