"""``--load-format dummy``: the released layout's random weights drawn in memory equal, tensor for
tensor, what ``make-random-checkpoint`` writes and ``load_model`` reads back, and they generate."""

from __future__ import annotations

import pytest
import torch

from deepserve.protocol import SamplingParams
from engine.errors import CheckpointError
from engine.generate import generate
from engine.model.loader import DummyTensors, FileTensors, load_model
from engine.model.random_checkpoint import preset_config, write_config_dir

LAYERS = 4  # sliding, sliding, CSA, HCA; the first three hash-routed


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, narrow_checkpoint_dir):
    """The written checkpoint (``make-random-checkpoint``, the run's shared one: LAYERS layers,
    seed 0, CPU) and the config-only directory of the same preset."""
    config_only = write_config_dir(tmp_path_factory.mktemp("dummy") / "config", preset_config("v4-flash-narrow", LAYERS))
    return narrow_checkpoint_dir, config_only


def test_dummy_tensors_are_the_written_checkpoint(dirs) -> None:
    """Same release names, shapes, dtypes and values as the files, shard by shard, MTP included."""
    files, config_only = dirs
    assert not list(config_only.glob("*.safetensors"))
    written, drawn = FileTensors(files, progress=False), DummyTensors(config_only, "cpu")
    assert written.keys == drawn.keys and any(k.startswith("mtp.0.") for k in drawn.keys)
    n = 0
    for (_, keys_f, get_f), (_, keys_d, get_d) in zip(written.shards(), drawn.shards(), strict=True):
        assert sorted(keys_f) == sorted(keys_d)
        for key in keys_f:
            a, b = get_f(key), get_d(key)
            assert (a.shape, a.dtype) == (b.shape, b.dtype), key
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), key
            n += 1
    assert n == len(drawn.keys)


@pytest.mark.slow  # ~30 s: two fp32 loads and two engines over a 129K-row head
def test_dummy_model_loads_and_generates_as_the_files(dirs) -> None:
    files, config_only = dirs
    a = load_model(files, dtype="float32", progress=False)
    b = load_model(config_only, dtype="float32", progress=False, load_format="dummy")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and set(a.mtp) == set(b.mtp)
    assert all(torch.equal(sa[k], sb[k]) for k in sa) and all(torch.equal(a.mtp[k], b.mtp[k]) for k in a.mtp)
    del a, b
    prompts = [(None, [5, 17, 300, 9000, 12]), (None, list(range(100, 140)))]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = [r["generated_ids"] for r in generate(str(config_only), prompts, greedy, dtype="float32", load_format="dummy")]
    want = [r["generated_ids"] for r in generate(str(files), prompts, greedy, dtype="float32")]
    assert got == want and all(len(g) == 6 for g in got)


def test_dummy_needs_a_release_layout_config(tmp_path) -> None:
    cfg = preset_config("v4-flash-narrow", 2)
    del cfg["o_groups"]
    with pytest.raises(CheckpointError, match="release-layout"):
        load_model(write_config_dir(tmp_path, cfg), dtype="float32", progress=False, load_format="dummy")
