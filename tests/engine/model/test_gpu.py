"""The model core on CUDA: fp32 parity with transformers, and bf16 as close as transformers' own.

Run on a GPU machine: ``pytest -m gpu tests/engine/model/test_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engine.model.loader import load_model  # noqa: E402


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 129280, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", autouse=True)
def _no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _hf(model_dir, dtype):
    return transformers.DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()


def _hf_logits(hf, ids, cache=None):
    with torch.no_grad():
        return hf(torch.tensor([ids], device="cuda"), past_key_values=cache, use_cache=True).logits[0].float()


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "small_windows_model_dir"])
def test_cuda_fp32_parity(request, fixture) -> None:
    model_dir = request.getfixturevalue(fixture)
    ours = load_model(model_dir, dtype="float32", device="cuda", progress=False)
    hf = _hf(model_dir, torch.float32)
    ids = _ids(300, 1)
    got = ours([(ours.new_state(), ids)], logits="all")
    assert (got - _hf_logits(hf, ids)).abs().max().item() <= 1e-4
    # decode 60 steps against transformers' cache
    st = ours.new_state()
    cache = transformers.DynamicCache(config=hf.config)
    ours([(st, ids[:200])])
    _hf_logits(hf, ids[:200], cache)
    worst = 0.0
    for t in range(200, 260):
        worst = max(worst, (ours([(st, ids[t : t + 1])])[0] - _hf_logits(hf, ids[t : t + 1], cache)[-1]).abs().max().item())
    assert worst <= 1e-4
    # mixed-length batch
    prompts = [_ids(n, 10 + n) for n in (5, 130, 47, 260)]
    batched = ours([(ours.new_state(), p) for p in prompts])
    for i, p in enumerate(prompts):
        assert (batched[i] - _hf_logits(hf, p)[-1]).abs().max().item() <= 1e-4


def test_cuda_bf16_as_close_as_transformers(tiny_model_dir) -> None:
    """bf16 cannot match fp32 exactly; ours must stay as close to the fp32 truth as transformers' bf16."""
    ref = _hf(tiny_model_dir, torch.float32)
    hf16 = _hf(tiny_model_dir, torch.bfloat16)
    ours16 = load_model(tiny_model_dir, dtype="bfloat16", device="cuda", progress=False)
    ids = _ids(260, 2)
    truth = _hf_logits(ref, ids)
    err_hf = (_hf_logits(hf16, ids) - truth).abs().mean().item()
    err_ours = (ours16([(ours16.new_state(), ids)], logits="all") - truth).abs().mean().item()
    assert err_ours <= 2 * err_hf + 1e-3, (err_ours, err_hf)


def test_rope_table_rows_equal_cos_sin() -> None:
    """``Rotary.table`` rows (one-chunk prefill, compressors) are ``cos_sin`` of their positions, bit for bit."""
    from engine.model.config import RopeParams
    from engine.model.rope import Rotary

    pos = torch.tensor([0, 1, 77, 4095, 4096, 9000], device="cuda")
    yarn = RopeParams(rope_type="yarn", theta=160000.0, factor=16.0, original_max_position_embeddings=65536)
    for params in (RopeParams(rope_type="default", theta=10000.0), yarn):
        rot = Rotary(params, 64, 1 << 20)
        for dtype in (torch.bfloat16, torch.float32):
            cos_t, sin_t = rot.table(9001, dtype, torch.device("cuda"))
            cos, sin = rot.cos_sin(pos, dtype)
            assert torch.equal(cos_t[pos], cos) and torch.equal(sin_t[pos], sin)
