"""DeepSeek-V4.1 model configuration, read from a checkpoint's ``config.json``.

Accepts the flat text config ``save_pretrained`` writes (``model_type: deepseek_v41_text``) and
the released composite one (``model_type: deepseek_v41`` with ``text_config`` / ``vision_config``
and a top-level ``quantization_config``). Missing schedule fields get the same defaults as
``transformers``' ``DeepseekV41TextConfig`` (the released 40-layer Flash schedule, or its scaled
version for other depths), so a checkpoint means the same model here and there.

Layer roles, all per layer index:

- ``compress_ratios[i]``: 0 = sliding window only, 1 = full-resolution shared KV ("decoder"),
  r > 1 = r tokens pooled into one compressed row ("encoder");
- ``kv_source_layer_ids``: layers owning a compressor; each publishes the compressed KV and
  the indexer keys that the layers up to the next source read;
- ``index_source_layer_ids``: layers running the sparse indexer (top-k of the shared rows),
  reused by the layers after them up to the next index source;
- ``candidate_source_layer_id``: the index source whose top blocks bound every later index
  source's choice (two-level top-k); negative disables it.

The layers from the first ratio-1 one on (``first_decoder_layer``) are the "decoder" (DeepInfer's
YOCO consumers); the layers before it the "encoder". ``use_fp4_sparse_kv`` (DeepInfer's text-config
key, default true; the ``transformers`` reference knows only FP4) picks the compressed KV's
rounding: FP4 e2m1 per 16 channels, or MXFP8 (false: e4m3 per 32 channels, UE8M0 scales, the
window KV's own format).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError
from engine.model.config import RopeParams, _parse_rope, config_value, dtype_name, eos_token_ids, read_config

MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")
# The released schedule, used when a 40-layer config gives no explicit one.
_FLASH_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20
_FLASH_KV_SOURCES = (2, 8, 14, 20)
_FLASH_INDEX_SOURCES = (2, 8, 14, 20, 24, 28, 32, 36)


@dataclass(frozen=True)
class V41Config:
    """Architecture hyper-parameters of a DeepSeek-V4.1 text backbone (defaults = V4.1-Flash)."""

    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    head_dim: int = 512
    q_lora_rank: int = 1280
    qk_rope_head_dim: int = 64
    max_position_embeddings: int = 1048576
    rope_main: RopeParams = field(default_factory=RopeParams)
    rope_compress: RopeParams = field(default_factory=lambda: RopeParams(theta=160000.0))
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = _FLASH_RATIOS
    kv_source_layer_ids: tuple[int, ...] = _FLASH_KV_SOURCES
    index_source_layer_ids: tuple[int, ...] = _FLASH_INDEX_SOURCES
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    use_fp4_sparse_kv: bool = True  # compressed KV rounded to FP4 (True) or MXFP8 (False)
    o_groups: int = 8
    o_lora_rank: int = 1024
    moe_intermediate_size: int = 2304
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = ()
    engram_vocab_size: int = 16000000
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 3  # DSpark draft layers (``dspark.py``), kept in ``model.mtp``
    dspark_block_size: int = 5  # tokens drafted per block
    dspark_noise_token_id: int = 128799  # fills the block's non-anchor positions
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)  # backbone layers whose attention input feeds the drafter
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    rms_norm_eps: float = 1e-20
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = (1,)
    torch_dtype: str = "bfloat16"
    tie_word_embeddings: bool = False
    quantization: dict[str, Any] | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        ratios = self.compress_ratios
        if len(ratios) != n:
            raise CheckpointError(f"config: compress_ratios needs {n} entries, got {len(ratios)}")
        if any(r < 0 for r in ratios):
            raise CheckpointError(f"config: negative compress ratio in {list(ratios)}")
        for name, ids in (("kv_source_layer_ids", self.kv_source_layer_ids), ("index_source_layer_ids", self.index_source_layer_ids)):
            bad = [i for i in ids if not 0 <= i < n or ratios[i] == 0]
            if bad:
                raise CheckpointError(f"config: {name} {bad} must be layers in [0, {n}) with compress_ratios > 0")
        if any(not any(s <= i for s in self.kv_source_layer_ids) for i in range(n) if ratios[i] > 0):
            raise CheckpointError("config: every layer with compress_ratios > 0 needs a kv_source_layer_ids entry at or before it")
        cand = self.candidate_source_layer_id
        if cand >= 0 and cand not in self.index_source_layer_ids:
            raise CheckpointError(f"config: candidate_source_layer_id {cand} must be one of index_source_layer_ids")
        # Schedules the reference cannot run (its forward fails on them): a layer reading a group's
        # compressed rows before any index source of that group chose among them, and an index
        # source filtering by the candidate blocks of another group's rows.
        for i in range(n):
            src = self.kv_source_of(i)
            if src is not None and not any(src <= j <= i for j in self.index_source_layer_ids):
                raise CheckpointError(
                    f"config: layer {i} reads the compressed rows of KV source {src}, but no index_source_layer_ids entry "
                    f"in [{src}, {i}] chooses among them"
                )
        if cand >= 0:
            other = [j for j in self.index_source_layer_ids if j > cand and self.kv_source_of(j) != self.kv_source_of(cand)]
            if other:
                raise CheckpointError(
                    f"config: index sources {other} come after candidate_source_layer_id {cand} but read another KV "
                    f"source's rows than it (its candidate blocks index KV source {self.kv_source_of(cand)})"
                )
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise CheckpointError("config: qk_rope_head_dim must be even and <= head_dim")
        if self.num_attention_heads * self.head_dim % self.o_groups:
            raise CheckpointError("config: num_attention_heads * head_dim must divide into o_groups")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise CheckpointError("config: engram_num_embeddings must have one entry per engram_layer_ids entry")
        if any(not 0 <= i < n for i in self.engram_layer_ids):
            raise CheckpointError(f"config: engram_layer_ids {list(self.engram_layer_ids)} out of range [0, {n})")
        if self.hidden_act != "silu":
            raise CheckpointError(f"config: hidden_act {self.hidden_act!r} unsupported (silu only)")

    # ---- layer roles ---------------------------------------------------------------------
    def kv_source_of(self, layer_idx: int) -> int | None:
        """The KV-source layer whose compressed rows ``layer_idx`` reads (None: window only)."""
        if self.compress_ratios[layer_idx] == 0:
            return None
        return max(s for s in self.kv_source_layer_ids if s <= layer_idx)

    @property
    def first_decoder_layer(self) -> int:
        """The first ratio-1 layer (DeepInfer's ``n_prefill_layer``; ``num_hidden_layers``: none)."""
        return next((i for i, r in enumerate(self.compress_ratios) if r == 1), self.num_hidden_layers)

    @property
    def unit_tokens(self) -> int:
        """Tokens per state block unit: 128, or a multiple that every compress ratio divides."""
        unit = 128
        while any(r and unit % r for r in self.compress_ratios):
            unit += 128
        return unit

    def fingerprint(self) -> str:
        """Short hash of the architecture (state records are only valid for the same one)."""
        payload = json.dumps({"family": "deepseek_v41", **asdict(self)}, sort_keys=True, default=str)
        return hashlib.blake2b(payload.encode(), digest_size=8).hexdigest()

    # ---- parsing -------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, model_dir: str | Path) -> V41Config:
        return read_config(model_dir, cls.from_dict)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> V41Config:
        """Parse a flat (``deepseek_v41_text``) or composite (``deepseek_v41``) config dict."""
        model_type = raw.get("model_type")
        if model_type not in MODEL_TYPES:
            raise CheckpointError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
        text = raw
        if model_type == "deepseek_v41":
            text = raw.get("text_config") or {}
            if not isinstance(text, dict):
                raise CheckpointError("text_config must be an object")

        def get(key: str, cast: Any) -> Any:
            return config_value(text, cls, key, cast)

        n = get("num_hidden_layers", int)
        head_dim = get("head_dim", int)
        ratios = _ratios(text.get("compress_ratios"), n, int(text.get("num_nextn_predict_layers") or 0))
        kv_sources = text.get("kv_source_layer_ids")
        if kv_sources is None:
            kv_sources = _FLASH_KV_SOURCES if ratios == _FLASH_RATIOS else [
                i for i in range(n) if ratios[i] > 0 and (i == 0 or ratios[i - 1] != ratios[i])
            ]
        index_sources = text.get("index_source_layer_ids")
        if index_sources is None:
            index_sources = _FLASH_INDEX_SOURCES if tuple(kv_sources) == _FLASH_KV_SOURCES else kv_sources
        candidate = text.get("candidate_source_layer_id")
        if candidate is None:
            candidate = kv_sources[-1] if kv_sources else -1
        rope_dim = get("qk_rope_head_dim", int)
        rope_main, rope_compress = _parse_rope(text)
        eos_ids = eos_token_ids(text.get("eos_token_id", raw.get("eos_token_id", 1)))
        qc = raw.get("quantization_config") or text.get("quantization_config")
        engram_ids = tuple(int(i) for i in text.get("engram_layer_ids") or ())
        engram_rows = text.get("engram_num_embeddings")
        taps = text.get("dspark_target_layer_ids")
        if taps is None:  # transformers' default: the last three layers that are no KV source
            taps = sorted(i for i in range(n) if i not in kv_sources)[-3:]
        return cls(
            vocab_size=get("vocab_size", int),
            hidden_size=get("hidden_size", int),
            num_hidden_layers=n,
            num_attention_heads=get("num_attention_heads", int),
            head_dim=head_dim,
            q_lora_rank=get("q_lora_rank", int),
            qk_rope_head_dim=rope_dim,
            max_position_embeddings=get("max_position_embeddings", int),
            rope_main=rope_main,
            rope_compress=rope_compress,
            sliding_window=get("sliding_window", int),
            compress_ratios=ratios,
            kv_source_layer_ids=tuple(int(i) for i in kv_sources),
            index_source_layer_ids=tuple(int(i) for i in index_sources),
            candidate_source_layer_id=int(candidate),
            candidate_topk_blocks=get("candidate_topk_blocks", int),
            candidate_block_size=get("candidate_block_size", int),
            index_n_heads=get("index_n_heads", int),
            index_head_dim=get("index_head_dim", int),
            index_topk=get("index_topk", int),
            use_fp4_sparse_kv=get("use_fp4_sparse_kv", bool),
            o_groups=get("o_groups", int),
            o_lora_rank=get("o_lora_rank", int),
            moe_intermediate_size=get("moe_intermediate_size", int),
            n_routed_experts=get("n_routed_experts", int),
            n_shared_experts=get("n_shared_experts", int),
            num_experts_per_tok=get("num_experts_per_tok", int),
            scoring_func=get("scoring_func", str),
            gate_temp=get("gate_temp", float),
            norm_topk_prob=get("norm_topk_prob", bool),
            routed_scaling_factor=get("routed_scaling_factor", float),
            swiglu_limit=get("swiglu_limit", float),
            hc_mult=get("hc_mult", int),
            hc_sinkhorn_iters=get("hc_sinkhorn_iters", int),
            hc_eps=get("hc_eps", float),
            engram_layer_ids=engram_ids,
            engram_vocab_size=get("engram_vocab_size", int),
            engram_num_embeddings=tuple(int(x) for x in engram_rows) if engram_rows is not None else (0,) * len(engram_ids),
            engram_max_ngram_size=get("engram_max_ngram_size", int),
            engram_n_heads=get("engram_n_heads", int),
            engram_head_dim=get("engram_head_dim", int),
            engram_pad_id=get("engram_pad_id", int),
            engram_compressed_vocab_size=get("engram_compressed_vocab_size", int),
            num_nextn_predict_layers=get("num_nextn_predict_layers", int),
            dspark_block_size=get("dspark_block_size", int),
            dspark_noise_token_id=get("dspark_noise_token_id", int),
            dspark_target_layer_ids=tuple(int(i) for i in taps),
            dspark_markov_rank=get("dspark_markov_rank", int),
            dspark_n_routed_experts=get("dspark_n_routed_experts", int),
            dspark_num_experts_per_tok=get("dspark_num_experts_per_tok", int),
            rms_norm_eps=get("rms_norm_eps", float),
            hidden_act=get("hidden_act", str),
            bos_token_id=text.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=dtype_name(text, raw, default="bfloat16"),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            quantization=qc if isinstance(qc, dict) else None,
        )


def _ratios(raw: list[int] | None, n: int, n_nextn: int) -> tuple[int, ...]:
    """The backbone's ``n`` compress ratios: explicit (trailing draft-layer entries dropped), the
    released schedule for 40 layers, or that schedule scaled to ``n`` (2 window-only layers, then
    half ratio-2, the rest ratio-1), as ``transformers`` derives it."""
    if raw is not None:
        ratios = [int(r) for r in raw]
        if not n <= len(ratios) <= n + n_nextn:
            raise CheckpointError(f"compress_ratios has {len(ratios)} entries for {n} layers (+{n_nextn} draft layers)")
        return tuple(ratios[:n])
    if n == len(_FLASH_RATIOS):
        return _FLASH_RATIOS
    n_slide = min(2, n)
    n_enc = max(0, (n - n_slide + 1) // 2)
    return (0,) * n_slide + (2,) * n_enc + (1,) * max(0, n - n_slide - n_enc)
