"""CompilePool: compiles in child processes; one past its deadline is killed, the next one runs."""

from __future__ import annotations

import json
import time

import pytest
from sampling_helpers import EOS, TOKENIZER_JSON, V4_VOCAB

from engine.sampling import InvalidConstraintError
from engine.sampling.compile_pool import CompilePool, CompileSettings
from engine.sampling.structured import load_tokenizer_info

SLOW = ("json", json.dumps({"type": "string", "pattern": "[a-z]{16000}"}), False)  # ~13 s to build on a quiet box (6,000: 1.7 s)


@pytest.fixture(scope="module")
def pool() -> CompilePool:
    return CompilePool(load_tokenizer_info(TOKENIZER_JSON, V4_VOCAB, [EOS]), CompileSettings(), timeout_s=1.5)


def test_a_compile_past_its_deadline_is_killed_and_the_next_runs(pool) -> None:
    assert pool.submit(("regex", "[ab]{2}", False)).result(timeout=120) is not None  # the child is up
    (thread,) = pool._threads
    t0 = time.monotonic()
    slow = pool.submit(SLOW)
    quick = pool.submit(("ebnf", 'root ::= "x"', False))
    with pytest.raises(InvalidConstraintError, match="did not compile within 1.5s"):
        slow.result(timeout=60)
    assert time.monotonic() - t0 < 5.0  # killed at the deadline, not after the ~10 s build
    assert quick.result(timeout=120) is not None  # on a fresh child
    assert quick.wait_excused(time.monotonic()) >= 1.5  # its wait behind the slow one is not its compile time
    assert thread.is_alive()


def test_compile_errors_come_back_as_invalid_constraints(pool) -> None:
    with pytest.raises(InvalidConstraintError, match="uniqueItems"):
        pool.submit(("json", json.dumps({"type": "array", "uniqueItems": True}), False)).result(timeout=120)
    with pytest.raises(InvalidConstraintError):
        pool.submit(("regex", "(", False)).result(timeout=120)
