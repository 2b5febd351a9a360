"""The static decode step over native weights (the checkpoint's FP8 linears and FP4 experts kept as
stored: ``load_model(fp8=..., fp4_experts=True)``) against the general path.

Two comparisons, both on ``make-random-checkpoint --preset v4-flash-narrow`` (every layer kind,
128-aligned blocks):

- **the same native model** (general path vs the slot step): the same function, the activations
  quantised the same way on both sides, so fp32 agrees to summation order (1e-4) — except where a
  summation-order difference of ~1e-6 moves an activation across an e4m3 rounding midpoint: that
  element then moves by a whole e4m3 step (up to 2^-3 of it) and, at an indexer score near the
  top-k cut, can swap a selected row. So most rows (``SAME_ROWS``) agree within 1e-4 and every row
  within a few percent (``FLIP``);
- **the same weights dequantised** (``load_model`` without the flags): the native path quantises
  every FP8 linear's input to e4m3 per 128-group (DeepSeek's inference does the same), a relative
  rounding of up to 2^-4 per element (3 mantissa bits), about 2^-4/√3 ≈ 3.6% rms of each FP8
  linear's output. About four FP8 linears act in series per layer (q_a → q_b, o_b, the shared
  expert's up and down), so after 4 layers √16 × 3.6% ≈ 15% rms relative on the logits;
  ``NATIVE_VS_DEQUANT`` bounds the rms over every (step, row) at twice that (the worst of 54 rows
  reached 40% on a GPU: a max over rows grows with their number, an rms does not). FP4 experts dequantise exactly
  (e2m1 × e8m0) and add nothing. The slot step must be no farther from the dequantised model
  than the native general path is (within ``FLIP``).

CPU: the plain step (no Triton; ``fp8_linear`` / ``moe_experts_fp4`` run their references). The
fused step with the Triton kernels (FP8 GEMM and GEMV, FP4 grouped) runs under the interpreter
(``slow``) and on the GPU with CUDA graphs (``gpu``; ``tests/engine/model/test_static_decode_native_gpu.py``).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from engine.model.fp8 import Fp8Linear, keeps_native_weights
from engine.model.loader import load_model
from engine.model.static_decode import StaticDecoder
from kernels.fp8_gemm import Fp8GemmConfig
from tests.engine.model.test_static_decode import assert_states_close, prefilled

NATIVE_VS_DEQUANT = 0.3  # relative logits error bound from the FP8 activation rounding (module docstring)
SAME_ROWS = 0.75  # share of (step, row) logits within 1e-4 of the native general path
FLIP = 0.05  # relative error of any row where a rounding midpoint was crossed
LENGTHS = [0, 3, 5, 130]  # fresh, before and after a CSA close, past a 128-token unit (window 128)


@pytest.fixture(scope="module")
def native_dir(narrow_checkpoint_dir: Path) -> Path:
    return narrow_checkpoint_dir  # make-random-checkpoint --preset v4-flash-narrow --layers 4, once per run


def native_model(path: Path, dtype: str = "float32", device: str = "cpu"):
    return load_model(path, dtype=dtype, device=device, progress=False, fp8=Fp8GemmConfig(), fp4_experts=True)


class Errors(NamedTuple):
    same: float  # share of rows within 1e-4 (abs) of the native general path
    flip: float  # worst relative error of a row against the native general path
    static: float  # rms over (step, row) of the slot step's relative error against ``dense``
    general: float  # the same of the native general path


def decode_both(native, dense, lengths: list[int], steps: int, seed: int, **kw) -> tuple[Errors, list, list, StaticDecoder]:
    """Teacher-forced decode through the native slot step, the native general path and the
    dequantised general path: (errors, native general states, exported slot states, the decoder)."""
    base = prefilled(native, lengths, seed)
    general = [s.clone() for s in base]
    dense_states = prefilled(dense, lengths, seed)
    dec = StaticDecoder(native, max_slots=len(lengths) + 1, max_tokens=max(lengths) + steps + 8, **kw)
    for i, st in enumerate(base):
        dec.load(i + 1, st)
    rng = random.Random(seed + 1)
    same, flip, static, plain = [], [], [], []
    for _ in range(steps):
        toks = [rng.randrange(2, 129280) for _ in lengths]
        want = native([(st, [t]) for st, t in zip(general, toks)]).float()
        ref = dense([(st, [t]) for st, t in zip(dense_states, toks)]).float()
        got = dec.step([i + 1 for i in range(len(lengths))], toks).float().to(want.device)
        same += ((got - want).abs().amax(dim=1) <= 1e-4).tolist()
        flip.append(((got - want).norm(dim=1) / want.norm(dim=1)).max().item())
        static += ((got - ref).norm(dim=1) / ref.norm(dim=1)).tolist()
        plain += ((want - ref).norm(dim=1) / ref.norm(dim=1)).tolist()
    rms = lambda e: (sum(x * x for x in e) / len(e)) ** 0.5  # noqa: E731
    errors = Errors(sum(same) / len(same), max(flip), rms(static), rms(plain))
    return errors, general, [dec.export(i + 1) for i in range(len(lengths))], dec


def check(e: Errors) -> None:
    """The bounds of the module docstring."""
    assert e.same >= SAME_ROWS and e.flip <= FLIP, e
    assert 0 < e.general <= NATIVE_VS_DEQUANT and e.static <= e.general + FLIP, e


def test_native_static_step_matches_general_path_on_cpu(native_dir: Path) -> None:
    native = native_model(native_dir)
    assert keeps_native_weights(native) and any(isinstance(m, Fp8Linear) for m in native.modules())
    assert native.model.layers[2].mlp.experts.fp4 is not None
    dense = load_model(native_dir, dtype="float32", progress=False)
    errors, general, exported, _ = decode_both(native, dense, LENGTHS, steps=4, seed=3)
    check(errors)
    for a, b in zip(general, exported):  # states: within the same flips (a flipped kv row)
        assert_states_close(a, b, 0.5)


_INTERPRETED = """
import sys
import torch
from pathlib import Path
from engine.model.loader import load_model
from engine.model.static_decode import DecodeTuning
from tests.engine.model.test_static_decode_native import check, decode_both, native_model
path = Path(sys.argv[1])
native, dense = native_model(path), load_model(path, dtype="float32", progress=False)
# batch 1 (FP4 expert GEMVs) and batch 3 (the FP8 GEMM, the grouped FP4 kernel); the projections'
# one-token GEMVs off: the interpreter runs the 129K-row lm_head a program at a time
# (kernels.fp8_gemv has its own interpreted tests)
for lens in ([5], [0, 3, 130]):
    errors, _, _, dec = decode_both(native, dense, lens, steps=1, seed=4, tuning=DecodeTuning(dense_gemv=False))
    assert dec.triton, lens
    check(errors)
print("ok")
"""


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_native_fused_step_under_interpreter(native_dir: Path) -> None:
    """The fused step's Triton kernels over native weights (FP8 GEMM, FP4 expert GEMVs at batch 1,
    grouped FP4 experts above) through Triton's CPU interpreter (a child process)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED, str(native_dir)], cwd=root, env=env, capture_output=True, text=True, timeout=1700, check=False)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_weights_option_selects_the_formats(native_dir: Path) -> None:
    """``--weights`` (``EngineConfig.weights``): native keeps FP8/FP4, dequantized does not, auto
    keeps them on CUDA only; an unknown value is refused."""
    from engine.runtime.builder import load_any_model, stores_quantized_weights
    from engine.runtime.config import EngineConfig

    assert stores_quantized_weights(native_dir)
    assert keeps_native_weights(load_any_model(native_dir, "float32", "cpu", weights="native"))
    assert not keeps_native_weights(load_any_model(native_dir, "float32", "cpu", weights="auto"))
    with pytest.raises(ValueError, match="weights"):
        EngineConfig(weights="fp8")  # type: ignore[arg-type]


def test_engine_on_native_weights_decodes_on_the_general_path_on_cpu(native_dir: Path) -> None:
    """On CPU the host slot decoder refuses native weights, so the engine decodes them on the
    general path: greedy tokens equal the native model's own prefill-then-decode run."""
    from deepserve.protocol import GenerateRequest, SamplingParams
    from engine.runtime.builder import build_engine
    from engine.runtime.config import EngineConfig
    from tests.engine.runtime.helpers import run

    engine = build_engine(native_dir, EngineConfig(max_num_seqs=2, weights="native"), dtype="float32")
    assert engine.static is None and keeps_native_weights(engine.model)
    ids = [0, 17, 4242, 99, 128000, 5]
    got = run(engine, [GenerateRequest("r", ids, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))])["r"].tokens
    state, feed, want = engine.model.new_state(), ids, []
    for _ in range(3):
        feed = [int(engine.model([(state, feed)])[0].argmax())]
        want += feed
    assert got == want
