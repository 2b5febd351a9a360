"""Rendering a huge prompt does not stall the gateway: conversion and tokenisation of large
bodies run on the render pool (server/render_pool.py), small ones inline. Real HTTP on loopback."""

from __future__ import annotations

import threading
import time

import httpx

from tests.server.conftest import MODEL

HUGE = "lorem ipsum dolor sit amet " * 120_000  # ~3.2M characters: ~1.5 s of encoding on one core


def test_a_small_request_completes_while_a_huge_one_is_rendered(gateway) -> None:
    done: dict[str, float] = {}

    def huge() -> None:
        r = httpx.post(gateway.url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": [{"role": "user", "content": HUGE}]})
        done["huge"] = time.monotonic()
        done["huge_status"] = r.status_code

    thread = threading.Thread(target=huge)
    thread.start()
    time.sleep(0.3)  # the huge body is in and being encoded
    t0 = time.monotonic()
    small = httpx.post(gateway.url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    done["small"] = time.monotonic()
    thread.join(60)
    assert small.status_code == 200
    assert done["huge_status"] == 400  # its ~800k tokens exceed the context, found once it is encoded
    assert done["small"] < done["huge"], f"the small request waited {done['small'] - t0:.2f}s for the huge one"


def test_small_bodies_render_inline_and_large_ones_on_the_pool(gateway) -> None:
    pool = gateway.state.render
    seen: list[str] = []

    def which() -> str:
        seen.append(threading.current_thread().name)
        return "ok"

    import asyncio

    async def both() -> None:
        await pool.run(10, which)
        await pool.run(pool.inline_bytes, which)

    asyncio.run(both())
    assert seen[0] == threading.current_thread().name and seen[1].startswith("render")
