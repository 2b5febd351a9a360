"""``deepserve generate`` on V4.1 checkpoints: the engine (scheduler, state pool, sampler) serves
the fixture checkpoints by token ids and gives the reference's greedy tokens."""

from __future__ import annotations

import json

import pytest

from deepserve.cli import main
from engine.generate import generate
from deepserve.protocol import SamplingParams
from tests.engine.model.v41.conftest import prompt_bar, fixture_case


@pytest.mark.parametrize("case", ["tester", "engram"])
def test_generate_gives_reference_greedy_tokens(case: str) -> None:
    ckpt, ref = fixture_case(case)
    prompts = [(None, p["prompt_ids"]) for p in ref["prompts"]]
    sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=1)
    rows = list(generate(str(ckpt), prompts, sampling, dtype="float32"))
    for i, (row, p) in enumerate(zip(rows, ref["prompts"])):
        assert row["generated_ids"] == p["greedy_tokens"]
        assert max(abs(a - b) for a, b in zip(row["logprobs"], p["greedy_logprobs"])) <= prompt_bar(case, i)


def test_cli_prompt_ids(capsys: pytest.CaptureFixture[str]) -> None:
    """``deepserve generate --prompt-ids`` through the CLI's ``main`` (in this process: a child's
    start would be seconds of imports; ``python -m deepserve.cli`` itself starts in every worker test)."""
    ckpt, ref = fixture_case("tester")
    p = ref["prompts"][0]
    argv = ["generate", "--model", str(ckpt), "--prompt-ids", ",".join(map(str, p["prompt_ids"])),
            "--max-tokens", "24", "--ignore-eos", "--top-logprobs", "1"]  # fmt: skip
    assert main(argv) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["generated_ids"] == p["greedy_tokens"]
    assert max(abs(a - b) for a, b in zip(row["logprobs"], p["greedy_logprobs"])) <= 1e-4
