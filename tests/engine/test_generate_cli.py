"""``deepserve generate`` on checkpoints written by transformers' ``save_pretrained`` from random
DeepseekV4Configs: same greedy tokens and top logprobs (≤ 1e-3) as transformers' ``generate``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from deepserve import cli

transformers = pytest.importorskip("transformers")

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


def random_config(seed: int):
    """A valid random DeepseekV4Config; each seed draws different sizes and layer schedules."""
    rng = random.Random(seed)
    n_layers = rng.randint(2, 4)
    heads = rng.choice([1, 2, 4])
    head_dim = rng.choice([32, 64])
    o_groups = rng.choice([g for g in (1, 2, 4) if heads * head_dim % g == 0])
    experts = rng.choice([4, 8])
    return transformers.DeepseekV4Config(
        vocab_size=rng.choice([300, 1000]),
        hidden_size=rng.choice([32, 64, 96]),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        head_dim=head_dim,
        q_lora_rank=rng.choice([16, 32]),
        o_groups=o_groups,
        o_lora_rank=rng.choice([8, 16]),
        n_routed_experts=experts,
        num_experts_per_tok=rng.randint(1, 3),
        moe_intermediate_size=rng.choice([16, 32]),
        index_n_heads=rng.choice([1, 2, 4]),
        index_head_dim=rng.choice([16, 32]),
        index_topk=rng.choice([2, 4, 64]),
        sliding_window=rng.choice([4, 8, 16, 128]),
        compress_rates={CSA: 4, HCA: rng.choice([8, 16, 128])},
        layer_types=[rng.choice([CSA, HCA, SWA]) for _ in range(n_layers)],
        num_hash_layers=rng.randint(0, n_layers),
        hc_mult=rng.choice([2, 4]),
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256} if rng.random() < 0.5 else None,
        scoring_func=rng.choice(["sqrtsoftplus", "sigmoid"]),  # transformers has no "softmax" activation
    )


@pytest.mark.parametrize("seed", [int(s) for s in __import__("os").environ.get("GEN_SEEDS", "11,22,33").split(",")])
def test_generate_matches_transformers(seed: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(seed)
    cfg = random_config(seed)
    hf = transformers.DeepseekV4ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "ckpt")
    rng = random.Random(seed)
    prompt = [rng.randrange(2, cfg.vocab_size) for _ in range(rng.randint(20, 150))]
    n = 24
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    ref_tokens = out.sequences[0, len(prompt):].tolist()
    ref_lp = [torch.log_softmax(step[0].float(), -1) for step in out.logits]

    # the console script's entry, in this process: a subprocess spent seconds of CPU importing torch
    # again (``python -m deepserve.cli`` itself runs in tests/server/test_cli.py). Rows go to
    # --output: write_results' stdout default is bound at import, before capture replaces stdout.
    rc = cli.main(["generate", "--model", str(tmp_path / "ckpt"), "--prompt-ids", ",".join(map(str, prompt)),
                   "--max-tokens", str(n), "--top-logprobs", "5", "--ignore-eos", "--dtype", "float32", "--output", str(tmp_path / "out.jsonl")])
    assert rc == 0, capsys.readouterr().err[-2000:]
    row = json.loads((tmp_path / "out.jsonl").read_text().strip().splitlines()[-1])
    assert row["generated_ids"] == ref_tokens
    for i, top in enumerate(row["top_logprobs"]):
        for token, lp in top:
            assert abs(lp - ref_lp[i][token].item()) <= 1e-3
        assert abs(row["logprobs"][i] - ref_lp[i][ref_tokens[i]].item()) <= 1e-3


def test_results_go_to_the_stdout_of_the_call(monkeypatch) -> None:
    """``write_results`` without ``out`` writes to ``sys.stdout`` as it is when called (a default
    bound at import would write to a stream swapped out since, e.g. a closed capture)."""
    import io

    from engine.generate import write_results

    buf = io.StringIO()
    monkeypatch.setattr("sys.stdout", buf)
    write_results(iter([{"a": 1}, {"b": [2]}]))
    assert buf.getvalue() == '{"a": 1}\n{"b": [2]}\n'
