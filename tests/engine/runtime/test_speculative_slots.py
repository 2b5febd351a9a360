"""Speculative steps that never leave the slots: sequences verifying in the host slots draft there
too (``slots.mtp_draft.SlotDrafter``). Their drafts are the general path's (``mtp.Drafter``), so
an engine drafting in the slots verifies and accepts exactly what one drafting on the general
path does, and both give the tokens of the engine without speculation."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
import pytest

from deepserve.protocol import GenerateRequest, SamplingParams
from engine.model.loader import load_model
from engine.model.tiny_mtp import TrainConfig, sentence
from engine.runtime.builder import build_engine
from engine.runtime.config import EngineConfig, SpeculativeConfig
from engine.runtime.metrics import EngineMetricFamilies, EngineMetrics

from helpers import memory_kv, prompt, run

LABELS = {"model_name": "m", "dp_rank": "0", "engine": "0"}


@pytest.fixture(scope="module")
def trained(trained_mtp_model_dir):
    return trained_mtp_model_dir, load_model(trained_mtp_model_dir, dtype="float32", progress=False)


def _engine(ckpt, model, k: int | None, slot_drafts: bool = True, **kw):
    reg = CollectorRegistry()
    spec = None if k is None else SpeculativeConfig("mtp", k)
    engine = build_engine(ckpt, EngineConfig(speculative=spec, max_num_seqs=8, **kw), model=model, metrics=EngineMetrics(EngineMetricFamilies(reg), "m", 0))
    if engine.spec is not None:
        engine.spec.slot_drafts = slot_drafts
    return engine, reg


def _counts(reg: CollectorRegistry) -> tuple[float, ...]:
    return tuple(reg.get_sample_value(f"vllm:spec_decode_{n}_total", LABELS) or 0.0 for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))


def _logging_drafts(engine) -> dict[str, list[list[int]]]:
    """Every draft list each request is given, step by step (``SpecDecoder._draft`` wrapped)."""
    log: dict[str, list[list[int]]] = {}
    inner = engine.spec._draft

    def logged(feeds, *a):
        inner(feeds, *a)
        for f in feeds:
            log.setdefault(f.seq.request_id, []).append(list(f.seq.draft_ids))

    engine.spec._draft = logged
    return log


def _requests() -> list[GenerateRequest]:
    """Mixed lengths; 100 + 40 and 240 + 40 tokens cross the 128-token units and the window."""
    lang = TrainConfig()
    prompts = [sentence(lang, 1003, 3), prompt(100, 1), prompt(230, 2) + sentence(lang, 1040, 10), prompt(7, 3) + [5] * 30]
    return [GenerateRequest(f"r{i}", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)) for i, p in enumerate(prompts)]


def test_slot_drafts_verify_what_general_drafts_do(trained) -> None:
    """k = 3 (drafts chained twice; every k is compared draft by draft in test_mtp_draft.py)."""
    ckpt, model = trained
    k = 3
    base = run(_engine(ckpt, model, None)[0], _requests())
    general, reg_general = _engine(ckpt, model, k, slot_drafts=False)
    slotted, reg_slotted = _engine(ckpt, model, k)
    logs = [_logging_drafts(general), _logging_drafts(slotted)]
    out_general, out_slotted = run(general, _requests()), run(slotted, _requests())
    want = {r: o.tokens for r, o in base.items()}
    assert {r: o.tokens for r, o in out_general.items()} == want and {r: o.tokens for r, o in out_slotted.items()} == want
    assert logs[0] == logs[1]  # step by step the same drafts
    assert _counts(reg_slotted) == _counts(reg_general) and _counts(reg_slotted)[2] > 0
    assert slotted.spec.slot_drafter is not None and slotted.spec.slot_drafter.steps > 0
    assert general.spec.slot_drafter is None


def test_kv_store_resume_with_slot_drafts(trained) -> None:
    """A conversation whose every turn resumes from the units the last turn stored (the MTP
    window restarts after the hit) gives the cold plain engine's tokens and the same drafts as
    general-path drafting."""
    ckpt, model = trained
    engines = [_engine(ckpt, model, 2, slot_drafts=s) for s in (True, False)]
    logs = [_logging_drafts(engine) for engine, _ in engines]
    for engine, _ in engines:
        engine.kv = memory_kv(model)
    cold = _engine(ckpt, model, None)[0]
    lang = TrainConfig()
    conversation = prompt(101, 11) + sentence(lang, 1005, 8)
    for turn in range(3):
        req = lambda rid: GenerateRequest(rid, list(conversation), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))  # noqa: E731
        want = run(cold, [req("c")])["c"].tokens
        got = [run(engine, [req(f"t{turn}")])[f"t{turn}"] for engine, _ in engines]
        assert all(g.tokens == want for g in got) and (turn == 0 or got[0].cached > 0)
        conversation += want + prompt(20, 100 + turn) + sentence(lang, 1010 + turn, 4)
    assert logs[0] == logs[1] and _counts(engines[0][1]) == _counts(engines[1][1]) and engines[0][0].spec.slot_drafter.steps > 0



def test_sequences_that_outgrow_their_slot_draft_on_from_the_exported_window(small_windows_model_dir) -> None:
    """Slots of 40 tokens on the small-windows checkpoint (window 16; an untrained MTP, whose
    drafts depend on every window entry): sequences leave their slot mid-run, their MTP windows
    exported back to the general path, which drafts on from them — step by step the very drafts
    of general-path drafting, and the plain tokens."""
    ckpt = small_windows_model_dir
    model = load_model(ckpt, dtype="float32", progress=False)
    reqs = lambda: [GenerateRequest(f"s{n}", prompt(n, n), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)) for n in (5, 17, 30)]  # noqa: E731
    base = run(_engine(ckpt, model, None)[0], reqs())
    (general, _), (slotted, _) = (_engine(ckpt, model, 3, slot_drafts=s, static_max_tokens=40) for s in (False, True))
    logs = [_logging_drafts(general), _logging_drafts(slotted)]
    want = {r: o.tokens for r, o in base.items()}
    assert {r: o.tokens for r, o in run(general, reqs()).items()} == want
    assert {r: o.tokens for r, o in run(slotted, reqs()).items()} == want
    assert logs[0] == logs[1] and slotted.spec.slot_drafter.steps > 0
