"""V4.1 cache rows as DeepInfer stores them: the model's fake-quantised values ⇄ bytes, exactly.

The model keeps its caches as fake-quantised values (``quant.py``: every value is a code times
its block's scale). A KV record stores the codes and scales themselves, in DeepInfer's row
formats (``engine.backends.deepinfer.layout``), so a row moves unchanged between our engine and a
DeepInfer one. A row of ``d`` values is its data bytes, then its scale bytes:

- ``FP8_WINDOW`` (window KV, 32-channel blocks): ``d`` e4m3 bytes, ``d/32`` UE8M0 bytes (``2^(b-127)``);
- ``FP4_MAIN`` (compressed KV, 16-channel blocks): ``d/2`` bytes of e2m1 pairs (element ``2j`` in the
  low nibble, the sign in bit 3), ``d/16`` e4m3 scale bytes;
- ``FP4_INDEX`` (indexer keys, 32-channel blocks): ``d/2`` e2m1-pair bytes, ``d/32`` UE8M0 bytes;
- ``MXFP8_MAIN`` (compressed KV of a ``use_fp4_sparse_kv: false`` checkpoint): the window's
  layout, ``d`` e4m3 bytes then ``d/32`` UE8M0 bytes (528 B at d = 512).

Encoding finds, per block, a scale under which every value is exactly a code times the scale
(the quantiser's own or an equivalent one: a power-of-two rescale of e4m3/e2m1 codes stays on
their grid) and checks the round trip, so a record either restores the exact values or is not
written (``ValueError``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.v41.quant import FP4_GRID, FP4_MAX, FP8_MAX, pow2_ceil


@dataclass(frozen=True)
class RowFormat:
    """One cache row format: ``block`` channels per scale, e2m1 (``fp4``) or e4m3 codes, e4m3 or
    UE8M0 (``e4m3_scale``) scales."""

    block: int
    fp4: bool
    e4m3_scale: bool

    def row_bytes(self, d: int) -> int:
        """Bytes of one encoded row of ``d`` values."""
        return (d // 2 if self.fp4 else d) + d // self.block

    def fits(self, d: int) -> bool:
        """Whether the model quantises rows of ``d`` values in this format (whole blocks only)."""
        return d % self.block == 0 and (not self.fp4 or d % 2 == 0)


FP8_WINDOW = RowFormat(block=32, fp4=False, e4m3_scale=False)
FP4_MAIN = RowFormat(block=16, fp4=True, e4m3_scale=True)
FP4_INDEX = RowFormat(block=32, fp4=True, e4m3_scale=False)
MXFP8_MAIN = RowFormat(block=32, fp4=False, e4m3_scale=False)  # DeepInfer's V41_FORMAT, as FP8_WINDOW

_E4M3_SCALE_FLOOR = 2.0**-9  # the compressed-KV quantiser's smallest scale (e4m3's smallest subnormal)


def _grid(device: torch.device) -> torch.Tensor:
    return torch.tensor(FP4_GRID, dtype=torch.float32, device=device)  # e2m1 magnitudes by code 0..7


def _scales(blocks: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """A scale per block ``(n, nb, 1)`` under which ``blocks (n, nb, b)`` are codes × scale."""
    amax = blocks.abs().amax(-1, keepdim=True)  # (n, nb, 1)
    if not fmt.e4m3_scale:  # a power of two: the largest code lands in (max/2, max]
        top = FP4_MAX if fmt.fp4 else FP8_MAX
        return torch.where(amax > 0, pow2_ceil(amax.clamp_min(torch.finfo(torch.float32).tiny) / top), torch.ones_like(amax))
    # e4m3 scale: the largest value is some nonzero e2m1 code times it; take the largest code
    # whose scale is an exact e4m3 number with every value of the block on the grid
    grid = _grid(blocks.device)
    best = torch.full_like(amax, _E4M3_SCALE_FLOOR)
    found = amax == 0
    for code in reversed(FP4_GRID[1:]):
        scale = amax / code
        exact = scale.to(torch.float8_e4m3fn).float() == scale
        q = (blocks / scale).abs()
        on_grid = (q.unsqueeze(-1) == grid).any(-1).all(-1, keepdim=True) & exact
        take = on_grid & ~found
        best = torch.where(take, scale, best)
        found = found | take
    return best


def _fp4_codes(q: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (sign in bit 3) of values already on the grid."""
    mag = torch.bucketize(q.abs(), _grid(q.device))  # exact grid values: their own index
    return (mag | (torch.signbit(q).to(mag.dtype) << 3)).to(torch.uint8)


def _scale_bytes(scale: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    if fmt.e4m3_scale:
        return scale.to(torch.float8_e4m3fn).view(torch.uint8)
    _, exponent = torch.frexp(scale)  # scale = 0.5 · 2^exponent
    return (exponent - 1 + 127).to(torch.uint8)


def encode_rows(x: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """Fake-quantised rows ``x (n, d)`` → their bytes ``(n, fmt.row_bytes(d))`` uint8, exactly."""
    n, d = x.shape
    if not fmt.fits(d):
        raise ValueError(f"rows of {d} values are not quantised in blocks of {fmt.block}")
    xf = x.detach().float().cpu()
    blocks = xf.reshape(n, d // fmt.block, fmt.block)  # (n, nb, b)
    scale = _scales(blocks, fmt)  # (n, nb, 1)
    q = (blocks / scale).reshape(n, d)
    if fmt.fp4:
        codes = _fp4_codes(q)
        data = codes[:, 0::2] | (codes[:, 1::2] << 4)  # (n, d/2): element 2j low, 2j+1 high
    else:
        data = q.to(torch.float8_e4m3fn).view(torch.uint8)  # (n, d)
    raw = torch.cat([data, _scale_bytes(scale.reshape(n, d // fmt.block), fmt)], dim=1)
    if not torch.equal(decode_rows(raw, d, fmt), xf):
        raise ValueError("rows are not on their quantisation grid; they cannot be stored exactly")
    return raw


def decode_rows(raw: torch.Tensor, d: int, fmt: RowFormat) -> torch.Tensor:
    """Bytes ``(n, fmt.row_bytes(d))`` uint8 → the rows ``(n, d)`` float32."""
    n = raw.shape[0]
    if raw.dtype != torch.uint8 or tuple(raw.shape) != (n, fmt.row_bytes(d)):
        raise ValueError(f"a {d}-value row is {fmt.row_bytes(d)} bytes, got {tuple(raw.shape)} {raw.dtype}")
    width = d // 2 if fmt.fp4 else d
    data, sb = raw[:, :width], raw[:, width:].contiguous()
    if fmt.fp4:
        codes = torch.stack([data & 0xF, data >> 4], dim=-1).reshape(n, d).long()  # (n, d)
        mag = _grid(raw.device)[codes & 7]
        q = torch.where(codes >= 8, -mag, mag)
    else:
        q = data.contiguous().view(torch.float8_e4m3fn).float()
    if fmt.e4m3_scale:
        scale = sb.view(torch.float8_e4m3fn).float()  # (n, nb)
    else:
        scale = torch.ldexp(torch.ones(sb.shape, dtype=torch.float32), sb.long() - 127)
    return (q.reshape(n, d // fmt.block, fmt.block) * scale.unsqueeze(-1)).reshape(n, d)
