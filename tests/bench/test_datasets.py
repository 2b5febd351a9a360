"""``deepserve bench serve --dataset-name random|sharegpt`` (vllm bench serve's datasets): the
requests they make, and the CLI end to end against a real gateway on loopback."""

from __future__ import annotations

import json

import deepseek_recipe as dr
import pytest

from bench.workloads import BlockContent, dataset_workload
from bench.workloads.datasets import RandomConfig
from server.model import package_tokenizer_path


@pytest.fixture(scope="module")
def tokenizer() -> dr.Tokenizer:
    return dr.Tokenizer.from_file(str(package_tokenizer_path()))


def _sharegpt(path, conversations: list[list[str]]) -> None:
    data = [{"id": f"c{i}", "conversations": [{"from": "human" if j % 2 == 0 else "gpt", "value": v} for j, v in enumerate(turns)]}
            for i, turns in enumerate(conversations)]
    path.write_text(json.dumps(data))


def test_random_lengths_range_and_shared_prefix(tokenizer) -> None:
    cfg = RandomConfig(input_len=100, output_len=20, prefix_len=32, range_ratio=0.5)
    wl = dataset_workload("random", 50, 7, random=cfg)
    assert len(wl.rows) == 50 and wl.prompts is None
    assert all(32 + 50 <= r.input_length <= 32 + 150 and 10 <= r.output_length <= 30 for r in wl.rows)
    assert len({r.input_length for r in wl.rows}) > 10  # drawn, not fixed
    content = BlockContent(wl.block_size)
    texts = [content.text(r.hash_ids, r.input_length, i) for i, r in enumerate(wl.rows[:3])]
    ids = [tokenizer.encode(t) for t in texts]
    assert [len(x) for x in ids] == [r.input_length for r in wl.rows[:3]]  # exact token counts
    assert ids[0][:32] == ids[1][:32] == ids[2][:32] and ids[0][32:40] != ids[1][32:40]
    assert dataset_workload("random", 50, 7, random=cfg).rows == wl.rows  # seeded


def test_sharegpt_first_turns_filtered_and_shuffled(tmp_path, tokenizer) -> None:
    long_reply = "word " * 3000
    convos = [[f"Question number {i} about the weather today?", f"Answer number {i}, it is sunny and warm."] for i in range(10)]
    convos += [["Hi", "A reply that is long enough."], ["A fine question here, is it not?", long_reply], ["Only one turn here."]]
    path = tmp_path / "sharegpt.json"
    _sharegpt(path, convos)
    wl = dataset_workload("sharegpt", 100, 0, path=str(path))
    assert len(wl.rows) == 10 and len(wl.prompts) == 10  # short prompt, too-long total and one-turn dropped
    assert set(wl.prompts) == {c[0] for c in convos[:10]} and list(wl.prompts) != [c[0] for c in convos[:10]]
    for row, prompt in zip(wl.rows, wl.prompts):
        i = int(prompt.split()[2])
        assert row.input_length == len(tokenizer.encode(prompt))
        assert row.output_length == len(tokenizer.encode(convos[i][1]))
    fixed = dataset_workload("sharegpt", 3, 0, path=str(path), output_len=2)
    assert [r.output_length for r in fixed.rows] == [2, 2, 2]
    with pytest.raises(ValueError, match="dataset-path"):
        dataset_workload("sharegpt", 3, 0)


def test_bench_serve_sends_the_sharegpt_prompts(two_model_gateway, tmp_path, tokenizer) -> None:
    """The CLI with vLLM's option names against a real gateway: each request's prompt is the
    ShareGPT text (the gateway counts its tokens: the text's plus BOS on completions)."""
    from deepserve.cli import main

    path = tmp_path / "sharegpt.json"
    _sharegpt(path, [[f"Tell me story number {i} about a cat.", "Once upon a time there was a cat."] for i in range(4)])
    out = tmp_path / "r.json"
    rc = main(["bench", "serve", "--base-url", two_model_gateway, "--endpoint", "completions", "--dataset-name", "sharegpt",
               "--dataset-path", str(path), "--num-prompts", "4", "--max-concurrency", "2", "--output", str(out),
               "--no-progress", "--warmup", "0"])
    assert rc == 0
    samples = json.loads(out.read_text())["runs"][0]["samples"]
    expected = sorted(len(tokenizer.encode(f"Tell me story number {i} about a cat.")) + 1 for i in range(4))
    assert sorted(s["prompt_tokens"] for s in samples) == expected


def test_bench_serve_random_dataset(two_model_gateway, tmp_path) -> None:
    from deepserve.cli import main

    out = tmp_path / "r.json"
    rc = main(["bench", "serve", "--url", two_model_gateway, "--endpoint", "completions", "--dataset-name", "random",
               "--random-input-len", "40", "--random-output-len", "3", "--random-prefix-len", "8", "--num-prompts", "3",
               "--output", str(out), "--no-progress", "--warmup", "0"])
    assert rc == 0
    samples = json.loads(out.read_text())["runs"][0]["samples"]
    assert [s["prompt_tokens"] for s in samples] == [49, 49, 49]  # BOS + 8 shared + 40
