"""Fused CPU loops (numba) for the small per-token parts of a step that eager PyTorch runs as
hundreds of tiny ops.

At decode on CPU a batch holds a few to a few dozen tokens, and the mHC mixing of one layer
(sigmoids, a 4×4 softmax, 20 Sinkhorn rounds) is ~120 PyTorch calls on ``(N, 4, 4)`` tensors:
the dispatch costs, not the arithmetic (likewise the ~12 ops of a partial RoPE, ``rope``, the
~25 of a small MoE block, ``experts``, and the stream merge, ``hc_merge``).
``hc_mix`` does the mHC arithmetic in fp32 in transformers' order (row-wise softmax, then
columns, then ``iters-1`` rounds of rows and columns, each ``x / (sum + eps)``) with the token
axis innermost, so it vectorises; only the rounding of ``exp`` may differ from PyTorch's by an
ulp. The products (``collapse``, ``hc_merge``, the experts) stream along contiguous output
axes and sum in a fixed order, so they differ from BLAS's summation order by rounding only.
Every token is computed alone, so results do not depend on the batch. ``available()`` compiles
the loops on first use (numba is a dependency; False only for a broken numba/llvmlite install).
"""

from __future__ import annotations

import numba
import numpy as np
import torch


_POW2 = np.array([2.0 ** (i - 126) for i in range(254)], np.float32)  # 2^-126 .. 2^127


def _exp(x: np.float32) -> np.float32:
    """``exp`` of a float32 within ~2 ulp of libm's, as plain arithmetic and one table read with
    no branch, so a loop calling it vectorises (libm's ``expf`` is a call per element). Inputs are
    clamped to [-87, 88] (results below ``exp(-87)`` round up to it: below every float32
    rounding step of the sums and products they enter); NaN stays NaN. Callers must not be
    compiled with reassociation: it could merge the two parts of ln 2."""
    nan = np.isnan(x)
    y = np.float32(0.0) if nan else min(max(x, np.float32(-87.0)), np.float32(88.0))
    k = np.floor(y * np.float32(1.4426950408889634) + np.float32(0.5))
    r = y - k * np.float32(0.693359375)  # Cody-Waite: ln 2 in two parts
    r = r - k * np.float32(-2.12194440e-4)
    p = np.float32(1.0 / 5040.0)
    p = p * r + np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    p = p * _POW2[np.int64(k) + 126]
    return x if nan else p


def _hc_mix(
    mixes: np.ndarray, scale: np.ndarray, base: np.ndarray, hc: int, iters: int, hc_eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """pre ``(hc, N)``, post ``(N, hc)``, comb ``(hc_i, hc_j, N)``: every loop runs along the
    token axis (contiguous), so the divisions and sums vectorise; per element the operations and
    their order are those of one token alone."""
    n = mixes.shape[0]
    one, two = np.float32(1.0), np.float32(2.0)
    eps = np.float32(hc_eps)
    m = np.ascontiguousarray(mixes.T)  # (M, N)
    pre = np.empty((hc, n), np.float32)
    post = np.empty((n, hc), np.float32)
    c = np.empty((hc, hc, n), np.float32)
    for s in range(hc):
        for t in range(n):
            pre[s, t] = one / (one + _exp(-(m[s, t] * scale[0] + base[s]))) + eps
            post[t, s] = two * (one / (one + _exp(-(m[hc + s, t] * scale[1] + base[hc + s]))))
    row_max = np.empty(n, np.float32)
    total = np.empty(n, np.float32)
    for i in range(hc):  # softmax over j, + eps
        row_max[:] = -np.inf
        for j in range(hc):
            k = 2 * hc + i * hc + j
            for t in range(n):
                v = m[k, t] * scale[2] + base[k]
                c[i, j, t] = v
                row_max[t] = max(row_max[t], v)
        total[:] = 0.0
        for j in range(hc):
            for t in range(n):
                c[i, j, t] = _exp(c[i, j, t] - row_max[t])
                total[t] += c[i, j, t]
        for j in range(hc):
            for t in range(n):
                c[i, j, t] = c[i, j, t] / total[t] + eps
    _normalise(c, hc, eps, total, False)
    for _ in range(iters - 1):
        _normalise(c, hc, eps, total, True)
        _normalise(c, hc, eps, total, False)
    return pre, post, c


def _normalise(c: np.ndarray, hc: int, eps: np.float32, total: np.ndarray, rows: bool) -> None:
    """``x / (sum + eps)`` over each row (``rows``) or column of every token's ``c[:, :, t]``."""
    n = c.shape[2]
    for a in range(hc):
        total[:] = 0.0
        for b in range(hc):
            i, j = (a, b) if rows else (b, a)
            for t in range(n):
                total[t] += c[i, j, t]
        for t in range(n):
            total[t] += eps
        for b in range(hc):
            i, j = (a, b) if rows else (b, a)
            for t in range(n):
                c[i, j, t] = c[i, j, t] / total[t]


def _collapse(pre: np.ndarray, streams: np.ndarray) -> np.ndarray:
    """``Σ_s pre[s, t] · streams[t, s, :]`` → ``(N, H)``, summed in stream order."""
    n, hc, h = streams.shape
    out = np.empty((n, h), np.float32)
    for t in range(n):
        p = pre[0, t]
        for k in range(h):
            out[t, k] = p * streams[t, 0, k]
        for s in range(1, hc):
            p = pre[s, t]
            for k in range(h):
                out[t, k] += p * streams[t, s, k]
    return out


def _merge(post: np.ndarray, comb: np.ndarray, block: np.ndarray, streams: np.ndarray) -> np.ndarray:
    """New streams ``out[t, i] = Σ_j comb[j, i, t] · streams[t, j] + post[t, i] · block[t]``
    (``comb`` as ``(hc_j, hc_i, N)``; the mixing summed in stream order, then the block term)."""
    n, hc, h = streams.shape
    out = np.empty((n, hc, h), np.float32)
    for t in range(n):
        for i in range(hc):
            w = comb[0, i, t]
            for k in range(h):
                out[t, i, k] = w * streams[t, 0, k]
            for j in range(1, hc):
                w = comb[j, i, t]
                for k in range(h):
                    out[t, i, k] += w * streams[t, j, k]
            p = post[t, i]
            for k in range(h):
                out[t, i, k] += p * block[t, k]
    return out


def _experts(
    x: np.ndarray, weights: np.ndarray, indices: np.ndarray, gate_up: np.ndarray, down: np.ndarray,
    shared_gate: np.ndarray, shared_up: np.ndarray, shared_down: np.ndarray, limit: float,
) -> np.ndarray:  # fmt: skip
    """Routed experts plus the shared expert for a few tokens: ``x (N, H)``, ``weights/indices
    (N, k)``, the weights in the model's own layouts (every product a contiguous dot, ``_dot``):
    ``gate_up (E, 2I, H)`` (gate rows first), ``down (E, H, I)``, shared ``(I', H)``, ``(I', H)``,
    ``(H, I')``. The (token, expert) slots are grouped by expert (counting sort: ascending
    expert, then token, then slot), so each weight row is read once per step for all its
    tokens; per token the chosen experts' weighted outputs are added in ascending expert order,
    then the shared expert's output (``Experts.forward`` + ``SharedMLP.forward``)."""
    n, h = x.shape
    k = indices.shape[1]
    e_count = gate_up.shape[0]
    i_dim = gate_up.shape[1] // 2
    start = np.zeros(e_count + 1, np.int64)
    for t in range(n):
        for j in range(k):
            start[indices[t, j] + 1] += 1
    for e in range(e_count):
        start[e + 1] += start[e]
    fill = start[:-1].copy()
    tok = np.empty(n * k, np.int64)
    wt = np.empty(n * k, np.float32)
    for t in range(n):
        for j in range(k):
            e = indices[t, j]
            tok[fill[e]] = t
            wt[fill[e]] = weights[t, j]
            fill[e] += 1
    out = np.zeros((n, h), np.float32)
    gu = np.empty((n * k, 2 * max(i_dim, shared_gate.shape[0])), np.float32)
    y = np.empty((n * k, h), np.float32)
    for e in range(e_count):
        a, b = start[e], start[e + 1]
        if a < b:
            _mlp_rows(x, tok[a:b], gate_up[e, :i_dim], gate_up[e, i_dim:], down[e], limit, gu, y)
            for s in range(a, b):
                t, w = tok[s], wt[s]
                for c in range(h):
                    out[t, c] += y[s - a, c] * w
    _mlp_rows(x, np.arange(n), shared_gate, shared_up, shared_down, limit, gu, y)
    for t in range(n):
        for c in range(h):
            out[t, c] += y[t, c]
    return out


def _mlp_rows(
    x: np.ndarray, tok: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray, limit: float, gu: np.ndarray,
    y: np.ndarray,
) -> None:  # fmt: skip
    """``y[s] = down(silu(min(gate·x[tok[s]], limit)) · clamp(up·x[tok[s]], ±limit))`` for the rows
    ``tok``; ``gate, up (I, H)``, ``down (H, I)``; ``gu`` scratch of at least ``(len(tok), 2I)``.
    Each weight row is used for every row of ``tok`` while it is in cache."""
    i_dim = gate.shape[0]
    m = tok.shape[0]
    lim = np.float32(limit)
    for o in range(i_dim):
        g_row, u_row = gate[o], up[o]
        for s in range(m):
            gu[s, o] = _dot(x[tok[s]], g_row)
            gu[s, i_dim + o] = _dot(x[tok[s]], u_row)
    for s in range(m):
        for o in range(i_dim):  # no reduction in this loop: it vectorises
            g = min(gu[s, o], lim)
            u = min(max(gu[s, i_dim + o], -lim), lim)
            gu[s, o] = g / (np.float32(1.0) + _exp(-g)) * u
    for c in range(down.shape[0]):
        d_row = down[c]
        for s in range(m):
            y[s, c] = _dot(gu[s, :i_dim], d_row)


def _dot(a: np.ndarray, b: np.ndarray) -> np.float32:
    """``Σ a·b`` in fp32, vectorised: compiled with reassociation, so the partial sums run in a
    fixed order of the compiled code's choosing — the same on every call, whatever the batch."""
    s = np.float32(0.0)
    for i in range(a.shape[0]):
        s += a[i] * b[i]
    return s


def _sum(a: np.ndarray) -> np.float32:
    """``Σ a`` in fp32, vectorised like ``_dot``."""
    s = np.float32(0.0)
    for i in range(a.shape[0]):
        s += a[i]
    return s


def _max(a: np.ndarray, m: np.float32) -> np.float32:
    """``max(m, max(a))`` over fp32 values with no NaN, vectorised (compiled with ``nnan``)."""
    for i in range(a.shape[0]):
        m = max(m, a[i])
    return m


def _inv_rms(row: np.ndarray, eps: float) -> np.float32:
    """``1 / sqrt(mean(row²) + eps)`` in fp32 (the sum of squares a vectorised ``_dot``)."""
    return np.float32(1.0) / np.sqrt(_dot(row, row) / np.float32(row.shape[0]) + np.float32(eps))


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, weighted: bool) -> np.ndarray:
    """Each row of ``x (R, H)`` times ``1/sqrt(mean(x²) + eps)`` (then ``weight`` when ``weighted``)."""
    r, h = x.shape
    out = np.empty((r, h), np.float32)
    for i in range(r):
        inv = _inv_rms(x[i], eps)
        if weighted:
            for c in range(h):
                out[i, c] = weight[c] * (x[i, c] * inv)
        else:
            for c in range(h):
                out[i, c] = x[i, c] * inv
    return out


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """A rotated copy of ``x (n, heads, D)`` (``_rope_in_place``)."""
    out = x.copy()
    _rope_in_place(out, cos, sin, 1.0)
    return out


def _rope_in_place(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, sign: float) -> None:
    """RoPE in place on the trailing rope channels of every head of ``x (n, heads, D)`` by ``cos/sin
    (n, R/2)`` (``sign`` -1 undoes it); per channel pair the products and sums of ``apply_rope``
    (no fused multiply-add), so the same values."""
    n, heads, d = x.shape
    half = cos.shape[1]
    start = d - 2 * half
    for t in range(n):
        for hd in range(heads):
            for i in range(half):
                even = x[t, hd, start + 2 * i]
                odd = x[t, hd, start + 2 * i + 1]
                c, s = cos[t, i], np.float32(sign) * sin[t, i]
                x[t, hd, start + 2 * i] = even * c - odd * s
                x[t, hd, start + 2 * i + 1] = odd * c + even * s


def _quantize_rows(x: np.ndarray, err_norm: float, w_norm: float, step: float) -> tuple[np.ndarray, np.ndarray, float]:
    """``lm_head.Int8Screen.quantize`` for the uint8 screen, per row in float64: codes ``qx + 128``
    (``qx = rint(x / sₓ)`` clamped to ±127, ``sₓ = max|x| / 127``, 1 for a zero row), the error
    bound in integer units and the largest ``‖qx‖``."""
    b_size, h = x.shape
    xu = np.empty((b_size, h), np.uint8)
    bound = np.empty(b_size, np.float64)
    top = 0.0
    for b in range(b_size):
        sx = 0.0
        for c in range(h):
            sx = max(sx, abs(np.float64(x[b, c])))
        sx = sx / 127.0
        if not sx > 0.0:
            sx = 1.0
        hat2 = 0.0
        err2 = 0.0
        q2 = 0.0
        for c in range(h):
            xd = np.float64(x[b, c])
            q = min(max(np.rint(xd / sx), -127.0), 127.0)
            xu[b, c] = np.uint8(q + 128.0)
            hat = q * sx
            hat2 += hat * hat
            err2 += (xd - hat) * (xd - hat)
            q2 += q * q
        bound[b] = (np.sqrt(hat2) * err_norm + np.sqrt(err2) * w_norm) * (1.0 + 1e-6) / (sx * step)
        top = max(top, np.sqrt(q2))
    return xu, bound, top


def _screen_pick(y: np.ndarray, margin: np.ndarray, w: np.ndarray, h: np.ndarray, limit: int, best: np.ndarray, row_max: np.ndarray) -> bool:
    """``lm_head`` screen → tokens: per row the maximum of the screened values ``y (B, V)``
    (integers), the candidates ``y ≥ max − margin`` and among them the best float64 logit
    ``w[v]·h[b]`` (lowest id on a tie; ``V`` when none is finite). False as soon as the
    candidates number more than ``limit`` in all (``best`` then partly set). Per row: maxima per
    block of ``SCREEN_BLOCK`` columns first (vectorised), then one walk over the blocks that reach
    the bar, scoring each candidate as it is found."""
    b_size, v_size = y.shape
    blk = SCREEN_BLOCK
    nb = (v_size + blk - 1) // blk
    bmax = np.empty(nb, y.dtype)
    d_size = w.shape[1]
    total = 0
    for b in range(b_size):
        row = y[b]
        top = row[0]
        for k in range(nb):
            seg = row[k * blk : (k + 1) * blk]  # indices from 0: provably in range, so it vectorises
            m = seg[0]
            for i in range(seg.shape[0]):  # from 0 (seg[0] again): a whole-block loop vectorises, ~4x faster
                m = max(m, seg[i])
            bmax[k] = m
            top = max(top, m)
        row_max[b] = top
        bar = np.int64(np.ceil(np.float64(top) - margin[b]))  # y is an integer: y >= thr <=> y >= ceil(thr)
        top_logit = -np.inf
        pick = v_size
        hb = h[b]
        for k in range(nb):
            if bmax[k] < bar:
                continue
            for v in range(k * blk, min(v_size, (k + 1) * blk)):
                if row[v] >= bar:
                    total += 1
                    wv = w[v]
                    acc = 0.0
                    for c in range(d_size):
                        acc += np.float64(wv[c]) * np.float64(hb[c])
                    if acc > top_logit:
                        top_logit = acc
                        pick = v
            if total > limit:  # too many candidates: stop at once
                return False
        best[b] = pick
    return True


SCREEN_BLOCK = 256

# error_model="numpy": a float division by zero gives inf, as in PyTorch, instead of a Python
# exception, whose check on every division kept the loops from vectorising
_exp = numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")(_exp)
_normalise = numba.njit(cache=True, nogil=True, error_model="numpy")(_normalise)
_hc_mix = numba.njit(cache=True, nogil=True, error_model="numpy")(_hc_mix)
_collapse = numba.njit(cache=True, nogil=True, error_model="numpy")(_collapse)
_merge = numba.njit(cache=True, nogil=True, error_model="numpy")(_merge)
_dot = numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "nsz", "contract"})(_dot)
_sum = numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "nsz", "contract"})(_sum)
_max = numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"nnan", "reassoc", "nsz"}, inline="always")(_max)
_mlp_rows = numba.njit(cache=True, nogil=True, error_model="numpy")(_mlp_rows)
_experts = numba.njit(cache=True, nogil=True, error_model="numpy")(_experts)
_rope_in_place = numba.njit(cache=True, nogil=True, error_model="numpy")(_rope_in_place)
_rope = numba.njit(cache=True, nogil=True, error_model="numpy")(_rope)
_inv_rms = numba.njit(cache=True, nogil=True, error_model="numpy")(_inv_rms)
_rms_norm = numba.njit(cache=True, nogil=True, error_model="numpy")(_rms_norm)
_screen_pick = numba.njit(cache=True, nogil=True, error_model="numpy")(_screen_pick)
_quantize_rows = numba.njit(cache=True, nogil=True, error_model="numpy")(_quantize_rows)

_state = {"ok": None}


def available() -> bool:
    """True when the compiled loops can run here (compiled on first use, cached on disk)."""
    if _state["ok"] is None:
        ok = True
        try:
            pre, post, comb = _hc_mix(np.zeros((1, 24), np.float32), np.ones(3, np.float32), np.zeros(24, np.float32), 4, 2, 1e-6)
            streams = np.zeros((1, 4, 8), np.float32)
            _merge(post, comb, _collapse(pre, streams), streams)
            _rms_norm(np.ones((1, 4), np.float32), np.ones(4, np.float32), 1e-6, True)
            w = np.zeros((1, 8, 4), np.float32)
            _experts(np.zeros((1, 4), np.float32), np.ones((1, 1), np.float32), np.zeros((1, 1), np.int64), w, w.transpose(0, 2, 1).copy(), w[0, :4], w[0, 4:], w[0, :4].T.copy(), 1.0)
            _rope(np.zeros((1, 1, 4), np.float32), np.ones((1, 2), np.float32), np.zeros((1, 2), np.float32))
            _screen_pick(np.zeros((1, 2), np.uint8), np.ones(1), np.zeros((2, 1), np.float32), np.zeros((1, 1), np.float32), 2, np.zeros(1, np.int64), np.zeros(1, np.uint8))
        except Exception:  # noqa: BLE001 - a broken numba/llvmlite install: keep the eager path
            ok = False
        _state["ok"] = ok
    return bool(_state["ok"])


def usable(x: torch.Tensor) -> bool:
    """True when ``x`` is an fp32 CPU tensor without grad and the compiled loops run here."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and not x.requires_grad and available()


def hc_mix(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, hc_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layers.mix_gates`` in one compiled call: ``pre (N, hc)``, ``post (N, hc)``, ``comb (N,
    hc, hc)`` (a view of an ``(hc, hc, N)`` array) from ``mixes (N, (2+hc)·hc)`` (fp32 CPU)."""
    pre, post, comb = _hc_mix(mixes.contiguous().numpy(), scale.detach().numpy(), base.detach().numpy(), hc, iters, hc_eps)
    return torch.from_numpy(pre).t(), torch.from_numpy(post), torch.from_numpy(comb).permute(2, 0, 1)


def hc_pre(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, streams: torch.Tensor, iters: int, hc_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hc_mix`` then ``layers.collapse``: ``post (N, hc)``, ``comb (N, hc, hc)`` and the block
    input ``(N, H)`` from fp32 CPU ``mixes`` and ``streams (N, hc, H)``."""
    hc = streams.shape[1]
    pre, post, comb = _hc_mix(mixes.contiguous().numpy(), scale.detach().numpy(), base.detach().numpy(), hc, iters, hc_eps)
    x = _collapse(pre, streams.contiguous().numpy())
    return torch.from_numpy(post), torch.from_numpy(comb).permute(2, 0, 1), torch.from_numpy(x)


def hc_merge(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """``layers.hc_merge`` for fp32 CPU tensors in one compiled loop (``comb (N, hc, hc)``)."""
    c = comb.permute(1, 2, 0)  # (hc_j, hc_i, N): contiguous when comb came from hc_mix/hc_pre
    return torch.from_numpy(_merge(post.contiguous().numpy(), c.contiguous().numpy(), block_out.contiguous().numpy(), streams.contiguous().numpy()))


def experts(
    x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, packed: tuple[np.ndarray, ...], limit: float
) -> torch.Tensor:
    """Routed + shared experts of a few fp32 CPU tokens in one compiled loop; ``packed`` from
    ``pack_experts``."""
    out = _experts(x.contiguous().numpy(), weights.float().contiguous().numpy(), indices.contiguous().numpy(), *packed, limit)
    return torch.from_numpy(out)


def pack_experts(gate_up: torch.Tensor, down: torch.Tensor, shared_gate: torch.Tensor, shared_up: torch.Tensor, shared_down: torch.Tensor) -> tuple[np.ndarray, ...]:
    """The weights ``experts`` reads: numpy views of the parameters (in-place writes show)."""
    return tuple(w.detach().numpy() for w in (gate_up, down, shared_gate, shared_up, shared_down))


NORM_ROWS = 64  # rows up to which ``rms_norm`` beats the eager ops (a few fp32 ops per row)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis of a contiguous fp32 CPU ``x`` in one compiled loop (the sum
    of squares in channel order), times ``weight`` when given."""
    h = x.shape[-1]
    w = _NO_WEIGHT if weight is None else weight.detach().numpy()
    return torch.from_numpy(_rms_norm(x.reshape(-1, h).numpy(), w, eps, weight is not None)).view(x.shape)


_NO_WEIGHT = np.ones(1, np.float32)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` for fp32 CPU ``x (N, ..., D)`` and ``cos/sin (N, R/2)`` in one loop: the
    same products and sums per channel pair (no fused multiply-add), so the same values."""
    n, d = x.shape[0], x.shape[-1]
    out = _rope(x.detach().reshape(n, -1, d).numpy(), cos.detach().contiguous().numpy(), sin.detach().contiguous().numpy())
    return torch.from_numpy(out).view(x.shape)


def quantize_rows(x: torch.Tensor, err_norm: float, w_norm: float, step: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``_quantize_rows`` of fp32 CPU rows ``x (B, H)``: uint8 codes, bounds ``(B,)`` float64, max ``‖qx‖``."""
    xu, bound, top = _quantize_rows(x.detach().contiguous().numpy(), err_norm, w_norm, step)
    return torch.from_numpy(xu), torch.from_numpy(bound), float(top)


def screen_pick(y: torch.Tensor, margin: torch.Tensor, weight_rows: torch.Tensor, hidden: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The exact greedy tokens ``(B,)`` and the screen's row maxima ``(B,)`` from an int8
    screen's output ``y (B, V)`` (uint8 or int32) and margins ``(B,)`` float64 (``lm_head``):
    one pass for the maxima, one for the candidates, float64 dot products for those only.
    None when there are more than ``limit`` candidates (the caller projects in full)."""
    b_size = y.shape[0]
    best = np.empty(b_size, np.int64)
    row_max = np.empty(b_size, y.numpy().dtype)
    ok = _screen_pick(y.numpy(), margin.contiguous().numpy(), weight_rows.detach().numpy(), hidden.detach().contiguous().numpy(), limit, best, row_max)
    return (torch.from_numpy(best), torch.from_numpy(row_max)) if ok else None
