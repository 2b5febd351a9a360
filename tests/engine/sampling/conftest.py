"""Fixtures for the sampling tests: the real DeepSeek V4 tokenizer and its grammar cache."""

from __future__ import annotations

import pytest
import torch
from sampling_helpers import EOS, TOKENIZER_JSON, V4_VOCAB

from engine.sampling import GrammarCompilerCache, Sampler, SamplerConfig


@pytest.fixture(scope="session")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER_JSON))


@pytest.fixture(scope="session")
def grammars() -> GrammarCompilerCache:
    return GrammarCompilerCache.from_tokenizer_json(TOKENIZER_JSON, V4_VOCAB, [EOS])


@pytest.fixture
def v4_sampler(grammars) -> Sampler:
    return Sampler(SamplerConfig(V4_VOCAB, (EOS,), seed=0), grammars)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The test box has 2 cores shared with other jobs; OpenMP barriers in 2-thread torch ops
    stall for whole time slices under that load, so these tests run torch single-threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
