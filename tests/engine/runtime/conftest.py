from __future__ import annotations

import pytest

from engine.model.loader import load_model


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    """The tiny checkpoint loaded once (fp32, CPU); engines built in tests share it."""
    return load_model(tiny_model_dir, dtype="float32", progress=False)
