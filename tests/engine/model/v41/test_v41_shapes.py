"""V4.1 checkpoints of other shapes than the fixtures' (schedules, KV sources, streams, windows,
head widths), written to disk and read by the real loader: the one-shot prefill, a chunked one,
the cached decode, the slot decoder, ``deepserve generate`` and a prefix resumed from the KV
store agree (fp32, CPU).

``index_topk`` is above every prompt's row count here. With fewer picks than rows, which rows a
query picks among exact relu-zero scores is torch.topk's tie order, and that depends on the score
tensor's width (all rows of a one-shot prompt, the rows so far of a chunk, a slot pool's
capacity): in a fuzz over 77 random valid shapes every difference between these paths came from such
ties, and none was left once the picks covered every row. (The fixtures were made where the
reference's own cached and full forwards agree, ``reference_cached_vs_full_max_abs``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deepserve.protocol import SamplingParams
from engine.generate import generate
from engine.model.v41.config import V41Config
from engine.model.v41.loader import load_v41_model
from engine.model.v41.model import DeepseekV41ForCausalLM
from engine.model.v41.slot_decode import V41SlotDecoder
from engine.model.v41.tiny import TINY_V41, random_v41_state_dict
from tests.engine.test_kv_units_v41 import assert_resumes_exactly

BASE = {**TINY_V41, "vocab_size": 512, "index_topk": 512}
SHAPES = {
    "ratio4_second_source": {  # a ratio-4 group after a ratio-2 one, one stream
        "num_hidden_layers": 3, "compress_ratios": [0, 2, 4], "kv_source_layer_ids": [1, 2],
        "index_source_layer_ids": [1, 2], "candidate_source_layer_id": 2, "hc_mult": 1, "sliding_window": 20,
    },
    "decoder_first": {  # a ratio-1 source as layer 0, narrow window, 2 wide heads, one output group
        "num_hidden_layers": 4, "compress_ratios": [1, 4, 4, 0], "kv_source_layer_ids": [0, 1],
        "index_source_layer_ids": [0, 1], "candidate_source_layer_id": 1, "sliding_window": 4,
        "num_attention_heads": 2, "head_dim": 64, "o_groups": 1, "index_head_dim": 64,
    },
    "sparse_schedule": {  # window-only layers between the readers of one source, three streams
        "num_hidden_layers": 6, "compress_ratios": [0, 2, 0, 2, 0, 2], "kv_source_layer_ids": [1],
        "index_source_layer_ids": [1, 5], "candidate_source_layer_id": 1, "hc_mult": 3, "sliding_window": 20,
    },
    "window_only": {
        "num_hidden_layers": 2, "compress_ratios": [0, 0], "kv_source_layer_ids": [], "index_source_layer_ids": [],
        "candidate_source_layer_id": -1, "qk_rope_head_dim": 16,
    },
}  # fmt: skip


def _checkpoint(root: Path, name: str) -> Path:
    raw = {**BASE, **SHAPES[name]}
    model = DeepseekV41ForCausalLM(V41Config.from_dict(raw), torch.float32)
    out = root / name
    out.mkdir()
    save_file(random_v41_state_dict(model, seed=len(name)), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw))
    return out


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_path_agrees_on_other_shapes(tmp_path: Path, name: str) -> None:
    ckpt = _checkpoint(tmp_path, name)
    model = load_v41_model(ckpt, dtype="float32")
    cfg = model.config
    prompt = torch.randint(2, cfg.vocab_size, (45,), generator=torch.Generator().manual_seed(1)).tolist()

    one = model([(model.new_state(), prompt)])[0]
    st = model.new_state()
    for a in range(0, len(prompt), 7):
        chunked = model([(st, prompt[a : a + 7])])[0]
    assert _close(chunked, one) <= 1e-5

    tokens, logits = list(prompt), chunked
    for _ in range(4):  # cached decode against a full forward of everything so far
        tokens.append(int(logits.argmax()))
        logits = model([(st, tokens[-1:])])[0]
        assert _close(logits, model([(model.new_state(), tokens)])[0]) <= 1e-5

    dec = V41SlotDecoder(model, 2, len(tokens) + 8)
    before = model.new_state()
    model([(before, tokens[:-1])])
    dec.load(1, before)
    got = dec.step([1], [tokens[-1]])[0]
    assert _close(got.float(), model([(before, tokens[-1:])])[0]) <= 1e-5

    sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    row = next(iter(generate(str(ckpt), [(None, prompt)], sampling, dtype="float32")))
    assert row["generated_ids"] == tokens[len(prompt) :]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_other_shapes_resume_from_the_store_exactly(tmp_path: Path, name: str) -> None:
    """Resumed after 1 or 2 units of 128 tokens: the cold logits of every later token, bit for bit."""
    model = load_v41_model(_checkpoint(tmp_path, name), dtype="float32")
    prompt = torch.randint(2, model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    assert_resumes_exactly(model, prompt, (128, 256))


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_short_prompts_load_into_the_slots(tmp_path: Path, name: str) -> None:
    """Prompts shorter than a source's ratio (no compressed row yet) or the window: the slot
    decoder loads their state and steps as the model does."""
    model = load_v41_model(_checkpoint(tmp_path, name), dtype="float32")
    dec = V41SlotDecoder(model, 2, 16)
    for n in (1, 3):
        st = model.new_state()
        model([(st, list(range(2, 2 + n)))])
        dec.load(0, st)
        got = dec.step([0], [7])[0]
        assert _close(got.float(), model([(st, [7])])[0]) <= 1e-5
