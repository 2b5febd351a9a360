"""The fake OpenAI worker's ``/kv_events``: both wire forms, the cursor, trimming."""

import asyncio

from aiohttp.test_utils import TestClient, TestServer

from bench.fake_openai_worker import FakeWorker, FakeWorkerConfig, build_app
from deepserve.protocol import KVEvent
from router.kv_index import KVIndex


def test_events_since_and_trimming():
    w = FakeWorker(FakeWorkerConfig(cache_blocks=2, max_events=8))
    for i in range(30):
        w.admit([f"k{i}"], 0, 128)
        assert w.seq == len(w.events) + w.first_seq - 1
        assert min(w.seq, 8) <= len(w.events) <= 10
        assert w.events_since(w.seq) == []
        assert w.events_since(w.seq - 1) == [w.events[-1]]
    assert w.events_since(0) == w.events  # a cursor older than what is kept: all kept


def test_kv_events_rows_and_objects_agree():
    async def main():
        cfg = FakeWorkerConfig(cache_blocks=3, dp_size=2)
        client = TestClient(TestServer(build_app(cfg)))
        await client.start_server()
        try:
            for i in range(6):
                r = await client.post("/internal/generate", json={"request_id": f"r{i}", "prompt_token_ids": [i] * 256, "dp_rank": i % 2, "sampling": {"max_tokens": 1}})
                await r.read()
            old = await (await client.get("/kv_events?since=1")).json()
            new = await (await client.get("/kv_events?since=1&format=rows")).json()
            assert old["seq"] == new["seq"] > 1 and "rows" not in old and "events" not in new
            assert [KVEvent.from_row(r) for r in new["rows"]] == [KVEvent.from_dict(e) for e in old["events"]]
            assert any(r[0] == 0 for r in new["rows"]) and any(r[0] == 1 for r in new["rows"])  # both ops
            a, b = KVIndex(), KVIndex()
            a.apply_raw("w", old["events"])
            b.apply_rows("w", new["rows"])
            assert a._holders == b._holders and list(a._holders) == list(b._holders)
        finally:
            await client.close()

    asyncio.run(main())
