"""``engine/model/tiny_mtp.py``: the trained tiny checkpoint continues its language, and so do its MTP drafts."""

from __future__ import annotations

import torch

from engine.model.loader import load_model
from engine.model.mtp import Drafter, MTPLayer
from engine.model.tiny_mtp import TrainConfig, sentence, successor, train_tiny_mtp


def test_language_is_a_seeded_permutation() -> None:
    cfg = TrainConfig(seed=4)
    nxt = successor(cfg)
    assert sorted(nxt) == list(range(cfg.first_id, cfg.first_id + cfg.vocab))
    assert nxt == successor(TrainConfig(seed=4)) != successor(TrainConfig(seed=5))
    s = sentence(cfg, cfg.first_id + 3, 6)
    assert all(b == nxt[a - cfg.first_id] for a, b in zip(s, s[1:]))


def test_trained_model_and_drafts_follow_the_language(trained_mtp_model_dir) -> None:
    model = load_model(trained_mtp_model_dir, dtype="float32", progress=False)
    cfg = TrainConfig()
    drafter = Drafter(model, MTPLayer.from_model(model))
    with torch.inference_mode():
        _drafts_follow(model, drafter, cfg)


def _drafts_follow(model, drafter: Drafter, cfg: TrainConfig) -> None:
    hits = total = 0
    for start in range(cfg.first_id, cfg.first_id + cfg.vocab, 7):  # sentences it never saw whole
        text = sentence(cfg, start, 12)
        streams = model([(model.new_state(), text[:8])], logits="streams")
        assert int(model.head.argmax(model.final_hidden(streams[-1:]))) == text[8]  # the main model continues it
        st = drafter.new_state()
        last = drafter.feed([st], [streams], [text[1:9]], [0])
        hits += sum(a == b for a, b in zip(drafter.propose([st], last, 3)[0], text[9:12]))
        total += 3
    assert hits / total > 0.8


def test_training_is_reproducible(small_windows_model_dir) -> None:
    short = TrainConfig(seed=2, sentences=4, seq_len=8, head_steps=2, mtp_steps=2, batch=2)
    runs = []
    for _ in range(2):
        model = load_model(small_windows_model_dir, dtype="float32", progress=False)
        mtp = MTPLayer.from_model(model)
        train_tiny_mtp(model, mtp, short)
        runs.append((model.lm_head.weight.detach().clone(), mtp.release_tensors()))
    (w1, m1), (w2, m2) = runs
    assert torch.equal(w1, w2) and all(torch.equal(m1[k], m2[k]) for k in m1)
    assert not torch.equal(w1, load_model(small_windows_model_dir, dtype="float32", progress=False).lm_head.weight)
