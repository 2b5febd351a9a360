"""DeepSeek-V4 model configuration, read from a checkpoint's ``config.json``.

Accepts both the layout ``transformers`` writes (``layer_types``, ``mlp_layer_types``,
``compress_rates``, nested ``rope_parameters``) and DeepSeek's legacy keys (``compress_ratios``,
``num_hash_layers``, ``qk_rope_head_dim``, flat ``rope_scaling``/``rope_parameters``), and folds
them into one frozen dataclass with the same defaults as ``transformers``' ``DeepseekV4Config``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from engine.errors import CheckpointError

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
MLP_TYPES = ("hash_moe", "moe")
_C = TypeVar("_C")
# config.json model_type -> model family (V4.1: engine/model/v41, flat text or composite config)
FAMILIES = {"deepseek_v4": "deepseek_v4", "deepseek_v41": "deepseek_v41", "deepseek_v41_text": "deepseek_v41"}


@dataclass(frozen=True)
class RopeParams:
    """One RoPE variant: ``main`` (sliding layers) or ``compress`` (CSA/HCA layers, often YaRN)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a DeepSeek-V4 checkpoint (defaults = V4-Flash)."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    q_lora_rank: int = 1024
    qk_rope_head_dim: int = 64
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    compress_rates: tuple[tuple[str, int], ...] = ((CSA, 4), (HCA, 128))
    rope_main: RopeParams = field(default_factory=RopeParams)
    rope_compress: RopeParams = field(default_factory=lambda: RopeParams(theta=160000.0))
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    torch_dtype: str = "bfloat16"
    tie_word_embeddings: bool = False
    quantization: dict[str, Any] | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if len(self.layer_types) != n or len(self.mlp_layer_types) != n:
            raise CheckpointError(f"config: layer_types/mlp_layer_types must have {n} entries")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES] + [t for t in self.mlp_layer_types if t not in MLP_TYPES]
        if bad:
            raise CheckpointError(f"config: unknown layer types {bad}")
        if self.num_attention_heads * self.head_dim % self.o_groups:
            raise CheckpointError("config: num_attention_heads * head_dim must divide into o_groups")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise CheckpointError("config: qk_rope_head_dim must be even and <= head_dim")

    def compress_rate(self, layer_type: str) -> int:
        """Source tokens per compressed row for a CSA/HCA layer type (0 for sliding layers)."""
        return dict(self.compress_rates).get(layer_type, 0) if layer_type != SLIDING else 0

    def layer_rate(self, layer_idx: int) -> int:
        return self.compress_rate(self.layer_types[layer_idx])

    @property
    def unit_tokens(self) -> int:
        """Tokens per KV-store block unit: 128, or a multiple that every compress rate divides."""
        unit = 128
        for _, rate in self.compress_rates:
            while unit % rate:
                unit += 128
        return unit

    def fingerprint(self) -> str:
        """Short hash of the architecture (KV records are only valid for the same one)."""
        payload = json.dumps(asdict(self), sort_keys=True, default=str)
        return hashlib.blake2b(payload.encode(), digest_size=8).hexdigest()

    # ---- parsing -------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        return read_config(model_dir, cls.from_dict)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type != "deepseek_v4":
            raise CheckpointError(f"model_type must be 'deepseek_v4' for this V4 config, got {model_type!r} (families: {', '.join(FAMILIES)})")
        d = _Defaults()
        n = int(raw.get("num_hidden_layers", d.num_hidden_layers))
        head_dim = int(raw.get("head_dim", d.head_dim))

        rates = dict(d.compress_rates)
        rates.update(raw.get("compress_rates") or {})
        if raw.get("compress_rate_csa") is not None:
            rates[CSA] = int(raw["compress_rate_csa"])
        if raw.get("compress_rate_hca") is not None:
            rates[HCA] = int(raw["compress_rate_hca"])

        layer_types = raw.get("layer_types")
        if layer_types is None and raw.get("compress_ratios") is not None:
            try:
                layer_types = [_RATIO_TO_LAYER_TYPE[int(r)] for r in raw["compress_ratios"]]
            except KeyError as exc:
                raise CheckpointError(f"compress_ratios: unsupported ratio {exc}") from exc
        if layer_types is None:
            interleave = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
            layer_types = [HCA] * min(n, 2) + interleave
        mlp_types = raw.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = raw.get("num_hash_layers")
            n_hash = 3 if n_hash is None else int(n_hash)
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)

        if raw.get("partial_rotary_factor") is not None:
            rope_dim = int(head_dim * float(raw["partial_rotary_factor"]))
        elif raw.get("qk_rope_head_dim") is not None:
            rope_dim = int(raw["qk_rope_head_dim"])
        else:
            rope_dim = head_dim // 8
        rope_main, rope_compress = _parse_rope(raw)

        eos_ids = eos_token_ids(raw.get("eos_token_id", 1))
        qc = raw.get("quantization_config")
        if isinstance(qc, dict) and raw.get("expert_dtype") and "expert_dtype" not in qc:
            qc = {**qc, "expert_dtype": raw["expert_dtype"]}

        def get(key: str, cast: Any) -> Any:
            return config_value(raw, ModelConfig, key, cast)

        return cls(
            vocab_size=get("vocab_size", int),
            hidden_size=get("hidden_size", int),
            moe_intermediate_size=get("moe_intermediate_size", int),
            num_hidden_layers=n,
            num_attention_heads=get("num_attention_heads", int),
            head_dim=head_dim,
            q_lora_rank=get("q_lora_rank", int),
            qk_rope_head_dim=rope_dim,
            num_experts_per_tok=get("num_experts_per_tok", int),
            n_routed_experts=get("n_routed_experts", int),
            n_shared_experts=get("n_shared_experts", int),
            scoring_func=get("scoring_func", str),
            routed_scaling_factor=get("routed_scaling_factor", float),
            max_position_embeddings=get("max_position_embeddings", int),
            layer_types=tuple(layer_types[:n]),
            mlp_layer_types=tuple(mlp_types[:n]),
            compress_rates=tuple(sorted((k, int(v)) for k, v in rates.items())),
            rope_main=rope_main,
            rope_compress=rope_compress,
            hc_mult=get("hc_mult", int),
            hc_sinkhorn_iters=get("hc_sinkhorn_iters", int),
            hc_eps=get("hc_eps", float),
            swiglu_limit=get("swiglu_limit", float),
            sliding_window=get("sliding_window", int),
            o_groups=get("o_groups", int),
            o_lora_rank=get("o_lora_rank", int),
            index_n_heads=get("index_n_heads", int),
            index_head_dim=get("index_head_dim", int),
            index_topk=get("index_topk", int),
            num_nextn_predict_layers=get("num_nextn_predict_layers", int),
            rms_norm_eps=get("rms_norm_eps", float),
            hidden_act=get("hidden_act", str),
            bos_token_id=raw.get("bos_token_id", d.bos_token_id),
            eos_token_ids=eos_ids,
            torch_dtype=dtype_name(raw, default=d.torch_dtype),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            quantization=qc if isinstance(qc, dict) else None,
        )


def model_type_of(model_dir: str | Path) -> str:
    """The ``model_type`` of a checkpoint's ``config.json``: it selects the model family."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing config.json")
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: invalid JSON object ({exc})") from exc
    if model_type not in FAMILIES:
        raise CheckpointError(f"{path}: unsupported model_type {model_type!r}; supported: {', '.join(FAMILIES)}")
    return model_type


def read_config(model_dir: str | Path, parse: Callable[[dict[str, Any]], _C]) -> _C:
    """``parse`` applied to a checkpoint's ``config.json``; errors name the file."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from exc
    try:
        return parse(raw)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass ``cls``'s field ``name`` (its factory called)."""
    f = cls.__dataclass_fields__[name]  # type: ignore[attr-defined]
    return f.default_factory() if f.default is MISSING else f.default


def config_value(src: dict[str, Any], cls: type, key: str, cast: Callable[[Any], Any]) -> Any:
    """``cast(src[key])``, or ``cls``'s field default where the key is missing or null."""
    return cast(src[key]) if src.get(key) is not None else field_default(cls, key)


def eos_token_ids(eos: int | list[int] | None) -> tuple[int, ...]:
    """A config's ``eos_token_id`` (one id, a list or null) as a tuple of ids."""
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))


def dtype_name(*sources: dict[str, Any], default: str) -> str:
    """The first ``dtype`` / ``torch_dtype`` set in ``sources`` (in order), without ``torch.``."""
    for src in sources:
        value = src.get("dtype") or src.get("torch_dtype")
        if value:
            return str(value).replace("torch.", "")
    return default


class _Defaults:
    """Attribute access to ModelConfig's field defaults (a default instance would not validate)."""

    def __getattr__(self, name: str) -> Any:
        return field_default(ModelConfig, name)


def _rope_from_dict(p: dict[str, Any], theta: float) -> RopeParams:
    rope_type = p.get("rope_type", p.get("type", "default")) or "default"
    attention_factor = p.get("attention_factor")
    if rope_type == "yarn" and attention_factor is None:
        attention_factor = 1.0  # V4 does not scale cos/sin by YaRN's mscale
    return RopeParams(
        rope_type=rope_type,
        theta=float(p.get("rope_theta", theta)),
        factor=p.get("factor"),
        original_max_position_embeddings=p.get("original_max_position_embeddings"),
        beta_fast=p.get("beta_fast"),
        beta_slow=p.get("beta_slow"),
        attention_factor=attention_factor,
        mscale=p.get("mscale"),
        mscale_all_dim=p.get("mscale_all_dim"),
        truncate=bool(p.get("truncate", True)),
    )


def _parse_rope(raw: dict[str, Any]) -> tuple[RopeParams, RopeParams]:
    theta = float(raw.get("rope_theta", 10000.0))
    compress_theta = float(raw.get("compress_rope_theta", 160000.0))
    rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main = _rope_from_dict(rp["main"], theta)
        compress = _rope_from_dict(rp["compress"], compress_theta)
    else:
        flat = {k: v for k, v in rp.items() if k not in ("main", "compress", "rope_theta", "partial_rotary_factor")}
        main = RopeParams(theta=theta)
        compress = _rope_from_dict(flat, compress_theta)
    if main.rope_type not in ("default", "yarn") or compress.rope_type not in ("default", "yarn"):
        raise CheckpointError(f"unsupported rope_type {main.rope_type!r}/{compress.rope_type!r}")
    return main, compress
