"""Load a DeepSeek-V4.1 checkpoint: ``config.json``, (sharded) safetensors, the engram tokenizer.

Names: ``save_pretrained``'s (``model.layers.0.attn.wq_a.weight``, ``lm_head.weight``) and the
released checkpoint's native ones (the same without ``model.``, ``head.weight``). Both map onto
this package's modules, which use the native names except for the mHC tensors
(``hc_attn_fn`` → ``hc_attn.fn``).

Precision: as stored, or FP8 e4m3 / packed FP4 with block scales (``*.scale``), dequantised on
load by V4's ``dequantize`` (the engram tables' per-32-channel scales included). Kept aside:
the DSpark draft layers (``mtp.*``, in ``model.mtp``). Not loaded, since serving is text only:
the vision tower, the aligner, the image delimiters and the routers' image-span ``bias_vl``.

An engram checkpoint is refused without its ``tokenizer.json`` (the hashes run over that
tokenizer's compressed vocabulary). Every tensor problem raises one ``CheckpointError`` naming
the file and the tensor.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import CheckpointError
from engine.model.loader import DTYPES, _is_scale_of_some, _scale_name, _shard_files, copy_checked, dequantize, shard_key_files
from engine.model.v41.attention import V41_TUNING, V41Tuning
from engine.model.v41.config import V41Config
from engine.model.v41.engram import NgramHasher
from engine.model.v41.model import DeepseekV41ForCausalLM

_TOP = {"embed.weight": "model.embed.weight", "norm.weight": "model.norm.weight", "head.weight": "lm_head.weight", "lm_head.weight": "lm_head.weight"}
_HC = re.compile(r"^hc_(attn|ffn)_(fn|base|scale)$")
_TEXT_ONLY_SKIP = re.compile(r"^(vision\.|aligner\.|image_(start|end|newline)$|layers\.\d+\.ffn\.gate\.bias_vl$)")


def to_internal_name(name: str) -> str | None:
    """The parameter a checkpoint tensor loads into (None: not used for text serving)."""
    bare = name.removeprefix("model.")
    if _TEXT_ONLY_SKIP.match(bare):
        return None
    if bare in _TOP:
        return _TOP[bare]
    m = re.match(r"^layers\.(\d+)\.(.*)$", bare)
    if not m:
        return "model." + bare
    rest = _HC.sub(r"hc_\1.\2", m.group(2))
    return f"model.layers.{m.group(1)}.{rest}"


def bind_hasher(cfg: V41Config, model_dir: Path) -> NgramHasher | None:
    """The engram hasher from the checkpoint's own ``tokenizer.json`` (None without engram)."""
    if not cfg.engram_layer_ids:
        return None
    tok = model_dir / "tokenizer.json"
    if not tok.is_file():
        raise CheckpointError(
            f"{model_dir}: engram layers {list(cfg.engram_layer_ids)} hash over the checkpoint's own tokenizer, "
            "but tokenizer.json is missing (another tokenizer would silently rehash the engram tables)"
        )
    return NgramHasher.build(cfg, tok)


def load_v41_model(
    model_dir: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu", tuning: V41Tuning = V41_TUNING,
) -> DeepseekV41ForCausalLM:  # fmt: skip
    """Build the V4.1 model from ``model_dir`` with weights loaded, on ``device`` in ``dtype``,
    its layers set by ``tuning``."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    cfg = V41Config.from_dir(model_dir)
    hasher = bind_hasher(cfg, model_dir)
    if dtype == "auto":
        dtype = cfg.torch_dtype if cfg.torch_dtype in DTYPES else "bfloat16"
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    files = _shard_files(model_dir)
    with torch.device(device):
        model = DeepseekV41ForCausalLM(cfg, torch_dtype, hasher, tuning)
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    loaded: set[str] = set()

    def assign(name: str, tensor: torch.Tensor, file: Path, key: str) -> None:
        if name not in params or name in loaded:
            raise CheckpointError(f"{file}: unexpected tensor {key!r}")
        copy_checked(params[name], tensor, file, key)
        loaded.add(name)

    key_file = shard_key_files(files)
    all_keys = set(key_file)
    scale_keys = {k for k in all_keys if _is_scale_of_some(k, all_keys)}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in sorted(set(f.keys()) - scale_keys):
                name = to_internal_name(key)
                if name is None:
                    continue
                tensor = f.get_tensor(key)
                scale_key = _scale_name(key, all_keys)
                if scale_key is not None and tensor.dtype.itemsize == 1:
                    with safe_open(str(key_file[scale_key]), framework="pt") as g:  # may sit in another shard
                        try:
                            tensor = dequantize(tensor, g.get_tensor(scale_key))
                        except RuntimeError as exc:
                            raise CheckpointError(f"{file}: tensor {key!r}: scale {scale_key!r} does not fit ({exc})") from exc
                if name.startswith("model.mtp."):
                    model.mtp[key] = tensor
                    continue
                assign(name, tensor, file, key)
    if cfg.tie_word_embeddings and "lm_head.weight" not in loaded:
        model.lm_head.weight = model.model.embed.weight
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensor {missing[0]!r}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
    return model.eval()
