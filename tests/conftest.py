"""Shared fixtures: tiny checkpoints made on the spot (once per session)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # tiny CPU ops: spin-waiting threads cost more than they give (see builder)

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
