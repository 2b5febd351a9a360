"""Schemathesis fuzz run against the gateway's OpenAPI schema (FAKE engine; bounded examples).

The same run against a live ``deepserve up`` is in ``test_e2e_openai.py``.
"""

from __future__ import annotations

from tests.server.fuzzing import fuzz


def test_fuzz_no_server_errors(gateway):
    seen = fuzz(gateway.url, max_examples=15)
    assert seen.get("2xx", 0) > 0 and seen.get("4xx", 0) > 0  # both valid and invalid inputs were tried
