"""The warp-specialised Hopper prefill attention compiles for sm_90a with the Triton installed
here (no GPU needed: Triton's own ptxas builds the cubin). Gluon's API moves between Triton
releases (3.6's ``async_copy_global_to_shared`` is 3.9's ``async_load``): this catches a kernel
that the installed Triton no longer builds before a Hopper machine does. Its results are checked
on the GPU (``test_prefill_attention_ws.py``)."""

from __future__ import annotations

import pytest

from kernels import prefill_attention_ws as ws

SIGNATURE = {
    **dict.fromkeys(["q_ptr", "keys_ptr", "rows_ptr"], "*bf16"),
    **dict.fromkeys(["idx_ptr", "slot_ptr", "swa_len_ptr", "row_len_ptr"], "*i32"),
    "sinks_ptr": "*fp32",
    "out_ptr": "*bf16",
    **dict.fromkeys(["stride_qb", "stride_qh", "stride_k", "stride_r", "stride_ib", "stride_ob", "stride_oh", "W", "K_ROWS", "n_tiles", "n_items", "n_hb"], "i32"),
    "qk_scale": "fp32",
    **dict.fromkeys(["D", "BN", "HAS_ROWS"], "constexpr"),
}


@pytest.mark.parametrize("has_rows", [True, False], ids=["picks", "window-only"])
def test_the_kernel_builds_for_sm90(has_rows) -> None:
    if ws.gluon is None:
        pytest.skip("this Triton has no Gluon")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    assert list(SIGNATURE) == ws._ws_attention_kernel.arg_names
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(17)}  # pointers and strides, as a launch specialises them
    src = GluonASTSource(ws._ws_attention_kernel, signature=SIGNATURE, attrs=aligned, constexprs={"D": 512, "BN": 64, "HAS_ROWS": has_rows})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 168})
    ptx = kernel.asm["ptx"]
    assert kernel.metadata.num_warps == 12  # softmax + value + loader warpgroups
    assert kernel.metadata.shared <= 227 * 1024  # one program per SM
    assert ptx.count("wgmma.mma_async") == 40  # 32 k-steps of the score dot, 4 + 4 of the two value halves
    assert "cp.async.mbarrier.arrive.noinc" in ptx
