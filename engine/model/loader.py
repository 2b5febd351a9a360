"""Load a DeepSeek-V4 checkpoint: ``config.json`` + (sharded) safetensors, two naming schemes.

Names: ``transformers``' (``model.layers.0.self_attn.q_a_proj.weight``, stacked experts) or
DeepSeek's original (``layers.0.attn.wq_a.weight``, one tensor per expert). Precision: fp32 /
bf16 / fp16 as stored, FP8 e4m3 with block scales (``*.scale`` or ``*.weight_scale_inv``, the
block size read off the scale grid, 128×128 in practice) and FP4 e2m1 experts (two values per
int8 byte, low nibble first, one scale per 32 inputs) dequantized on load. Every problem raises
one ``CheckpointError`` naming the file and the tensor.

``load_format="dummy"`` (vLLM's spelling) reads no weight files: the tensors of the released
V4-Flash layout for the directory's ``config.json`` are drawn on the target device by
``engine.model.random_checkpoint.random_tensors`` (what ``make-random-checkpoint`` writes, value
for value at the same seed and device) and loaded through the same path as a file's.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.errors import CheckpointError
from engine.model.config import ModelConfig
from engine.model.fp8 import replace_linear
from engine.model.model import TUNING, DeepseekV4ForCausalLM, ModelTuning
from kernels.fp8_gemm import Fp8GemmConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Original DeepSeek names -> transformers names, applied in order to the part after "layers.N.".
_LAYER_RENAMES: list[tuple[str, str]] = [
    (r"^attn\.indexer\.compressor\.", "self_attn.compressor.indexer."),
    (r"^attn\.indexer\.wq_b\.", "self_attn.compressor.indexer.q_b_proj."),
    (r"^attn\.indexer\.weights_proj\.", "self_attn.compressor.indexer.scorer.weights_proj."),
    (r"^attn\.norm\.", "self_attn.kv_norm."),
    (r"^attn\.", "self_attn."),
    (r"^ffn\.", "mlp."),
    (r"^attn_norm\.", "input_layernorm."),
    (r"^ffn_norm\.", "post_attention_layernorm."),
    (r"^hc_attn_(fn|base|scale)$", r"attn_hc.\1"),
    (r"^hc_ffn_(fn|base|scale)$", r"ffn_hc.\1"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.ape$", ".position_bias"),
    (r"(compressor(\.indexer)?)\.norm\.", r"\1.kv_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]
_TOP_RENAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
_SCALE_SUFFIXES = (".scale", "_scale_inv", ".weight_scale_inv")
_FP4_LUT = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def to_hf_name(name: str) -> str:
    """Map a tensor name to transformers' in-memory name.

    Accepts transformers' names, DeepSeek's original names, and the mix ``save_pretrained``
    writes (original layer names under a ``model.`` prefix, e.g. ``model.layers.0.attn.wq_a.weight``).
    """
    if name.startswith("lm_head."):
        return name
    bare = name.removeprefix("model.")
    if bare in _TOP_RENAMES:
        return _TOP_RENAMES[bare]
    m = re.match(r"^layers\.(\d+)\.(.*)$", bare)
    if not m:
        return "model." + bare
    rest = m.group(2)
    for pattern, repl in _LAYER_RENAMES:
        rest = re.sub(pattern, repl, rest)
    return f"model.layers.{m.group(1)}.{rest}"


def _scale_name(weight_name: str, keys: set[str]) -> str | None:
    base = weight_name.removesuffix(".weight")
    for cand in (base + ".scale", weight_name + "_scale_inv", base + ".weight_scale_inv"):
        if cand in keys:
            return cand
    return None


def _unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    u8 = packed.contiguous().view(torch.uint8)
    low, high = (u8 & 0xF).long(), (u8 >> 4).long()
    lut = _FP4_LUT.to(u8.device)
    return torch.stack([lut[low], lut[high]], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3 (or int8-packed FP4) weight × its block-scale grid → float32."""
    w = _unpack_fp4(weight) if weight.dtype in (torch.int8, torch.uint8) else weight.to(torch.float32)
    if scale.dtype == torch.uint8:  # e8m0 exponents stored as bytes
        s = (scale.to(torch.float32) - 127.0).exp2()
    else:
        s = scale.to(torch.float32)
    s = s.reshape(w.shape[:-2] + s.shape[-2:]) if s.dim() >= 2 else s.reshape(1, 1)
    rows, cols = w.shape[-2:]
    bm, bn = -(-rows // s.shape[-2]), -(-cols // s.shape[-1])
    full = s.repeat_interleave(bm, dim=-2)[..., :rows, :].repeat_interleave(bn, dim=-1)[..., :cols]
    return w * full


def _shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: malformed index ({exc})") from exc
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: shard listed in {index.name} is missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    return files


def copy_checked(target: torch.Tensor, tensor: torch.Tensor, file: Path, key: str) -> None:
    """Copy checkpoint tensor ``key`` of ``file`` into a parameter or buffer (cast to its dtype);
    a shape mismatch is one ``CheckpointError`` naming file and tensor."""
    if tuple(tensor.shape) != tuple(target.shape):
        raise CheckpointError(f"{file}: tensor {key!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor.to(target.dtype))


def shard_key_files(files: list[Path]) -> dict[str, Path]:
    """The shard that holds each tensor key of a checkpoint."""
    key_file: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            key_file.update({k: file for k in f.keys()})
    return key_file


Shard = tuple[Path, list[str], Callable[[str], torch.Tensor]]  # (where, its keys, key -> tensor)


class FileTensors:
    """A checkpoint's tensors read from its safetensors shards."""

    def __init__(self, model_dir: Path, progress: bool) -> None:
        self.files = _shard_files(model_dir)
        self.key_file = shard_key_files(self.files)
        self.keys = set(self.key_file)
        self.progress = progress

    def shards(self) -> Iterator[Shard]:
        bar = tqdm(self.files, desc="loading shards", unit="shard", disable=not self.progress, file=sys.stderr)
        for file in bar:
            with safe_open(str(file), framework="pt") as f:
                yield file, list(f.keys()), f.get_tensor

    def get(self, key: str) -> torch.Tensor:
        """Any shard's tensor (a weight's scale may sit in another shard)."""
        with safe_open(str(self.key_file[key]), framework="pt") as g:
            return g.get_tensor(key)


class DummyTensors:
    """The released layout's random tensors for ``model_dir``'s ``config.json``, drawn on
    ``device`` one shard at a time (``load_format="dummy"``; no weight file is read)."""

    def __init__(self, model_dir: Path, device: str | torch.device, seed: int = 0) -> None:
        from engine.model.random_checkpoint import shard_specs

        self.model_dir, self.device, self.seed = model_dir, device, seed
        self.cfg = json.loads((model_dir / "config.json").read_text())
        self.mtp = int(self.cfg.get("num_nextn_predict_layers", 0)) > 0
        try:
            self.keys = {s.name for shard in shard_specs(self.cfg, self.mtp) for s in shard}
        except (KeyError, IndexError, TypeError) as exc:
            raise CheckpointError(f"{model_dir}/config.json: not a DeepSeek-V4 release-layout config for --load-format dummy ({exc!r} missing)") from exc
        self._shard: dict[str, torch.Tensor] = {}

    def shards(self) -> Iterator[Shard]:
        from engine.model.random_checkpoint import random_tensors

        for i, self._shard in enumerate(random_tensors(self.cfg, self.mtp, self.seed, self.device)):
            yield self.model_dir / f"<dummy shard {i}>", list(self._shard), self._shard.__getitem__
        self._shard = {}

    def get(self, key: str) -> torch.Tensor:
        return self._shard[key]  # the random layout keeps each scale beside its weight


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    progress: bool = True,
    fp8: Fp8GemmConfig | None = None,
    fp4_experts: bool = False,
    tuning: ModelTuning = TUNING,
    load_format: Literal["auto", "dummy"] = "auto",
) -> DeepseekV4ForCausalLM:
    """Build the model from ``model_dir`` with weights loaded, on ``device`` in ``dtype``, its
    kernels set by ``tuning``.

    ``fp8``: keep every FP8 block-scaled linear weight as FP8 (``engine.model.fp8.Fp8Linear``, this
    GEMM tiling); None dequantises them to ``dtype`` (the parity path). ``fp4_experts``: keep FP4
    routed experts with e8m0 scales packed as stored (``Experts.fp4``, run by ``kernels.moe_fp4``;
    the general forward only, not the slot decoders) instead of dequantising them.
    ``load_format``: ``auto`` reads the safetensors, ``dummy`` draws random weights (module docstring)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    cfg = ModelConfig.from_dir(model_dir)
    if dtype == "auto":
        dtype = cfg.torch_dtype if cfg.torch_dtype in DTYPES else "bfloat16"
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    if load_format not in ("auto", "dummy"):
        raise CheckpointError(f"unknown load format {load_format!r} (auto or dummy)")
    source = DummyTensors(model_dir, device) if load_format == "dummy" else FileTensors(model_dir, progress)
    with torch.device(device):
        model = DeepseekV4ForCausalLM(cfg, torch_dtype, tuning, fp4_experts)
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    loaded: set[str] = set()
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    packed: dict[str, dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]] = defaultdict(lambda: defaultdict(dict))

    def dense_experts(prefix: str) -> None:
        """Allocate the dense parameters of experts built for FP4 whose checkpoint tensors are dense."""
        experts = model.get_submodule(prefix)
        e, two_i, h = experts.shape
        experts.gate_up_proj = torch.nn.Parameter(torch.empty(e, two_i, h, dtype=torch_dtype, device=device))
        experts.down_proj = torch.nn.Parameter(torch.empty(e, h, two_i // 2, dtype=torch_dtype, device=device))
        params.update({f"{prefix}.gate_up_proj": experts.gate_up_proj, f"{prefix}.down_proj": experts.down_proj})

    def assign(name: str, tensor: torch.Tensor, file: Path) -> None:
        if name not in params:
            raise CheckpointError(f"{file}: unexpected tensor {name!r}")
        if fp4_experts and params[name].numel() == 0 and name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            dense_experts(name.rsplit(".", 1)[0])
        copy_checked(params[name], tensor, file, name)
        loaded.add(name)

    all_keys = source.keys
    scale_keys = {k for k in all_keys if k.endswith(_SCALE_SUFFIXES) and _is_scale_of_some(k, all_keys)}
    scale_of = source.get

    def stack_experts(prefix: str, per_expert: dict[int, dict[str, torch.Tensor]], where: Path) -> None:
        n = cfg.n_routed_experts
        gate_up = torch.stack([torch.cat([per_expert[e]["w1"], per_expert[e]["w3"]]) for e in range(n)])
        assign(f"{prefix}.gate_up_proj", gate_up, where)
        del gate_up
        assign(f"{prefix}.down_proj", torch.stack([per_expert[e]["w2"] for e in range(n)]), where)

    for file, keys, get in source.shards():
        for key in sorted(set(keys) - scale_keys):
            tensor = get(key)
            scale_key = _scale_name(key, all_keys)
            name = to_hf_name(key)
            if fp8 is not None and scale_key is not None and tensor.dtype == torch.float8_e4m3fn:
                if replace_linear(model, name, tensor, scale_of(scale_key), fp8):
                    loaded.add(name)
                    continue
            m = _EXPERT_RE.match(name)
            if fp4_experts and m and scale_key is not None and tensor.dtype == torch.int8:
                scale = scale_of(scale_key)
                if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):  # e8m0 exponents: the kernel's format
                    prefix = m.group(1)
                    packed[prefix][int(m.group(2))][m.group(3)] = (tensor, scale.view(torch.float8_e8m0fnu))
                    if _experts_complete(packed[prefix], cfg.n_routed_experts):  # one layer's unstacked codes at a time
                        _keep_fp4_experts(model.get_submodule(prefix), packed.pop(prefix), cfg.n_routed_experts, f"{model_dir}: experts of {prefix!r}")
                        loaded.update({f"{prefix}.gate_up_proj", f"{prefix}.down_proj"})
                    continue
            if scale_key is not None and tensor.dtype.itemsize == 1:
                tensor = dequantize(tensor, scale_of(scale_key)).to(torch_dtype)  # held in the model's dtype, not fp32
            if key.startswith(("mtp.", "model.mtp.")):
                model.mtp[key] = tensor
                continue
            if m:
                per_expert = experts[m.group(1)]
                per_expert[int(m.group(2))][m.group(3)] = tensor
                if _experts_complete(per_expert, cfg.n_routed_experts):  # one layer's stack in memory at a time
                    stack_experts(m.group(1), experts.pop(m.group(1)), model_dir)
                continue
            try:
                assign(name, tensor, file)
            except RuntimeError as exc:
                raise CheckpointError(f"{file}: tensor {name!r}: {exc}") from exc
    if experts:
        prefix = next(iter(experts))
        raise CheckpointError(f"{model_dir}: experts of {prefix!r} incomplete (need w1/w2/w3 for {cfg.n_routed_experts} experts)")
    for prefix, per_expert in packed.items():  # only incomplete layers are left: this names the first
        _keep_fp4_experts(model.get_submodule(prefix), per_expert, cfg.n_routed_experts, f"{model_dir}: experts of {prefix!r}")
    if cfg.tie_word_embeddings and "lm_head.weight" not in loaded:
        model.lm_head.weight = model.model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensor {missing[0]!r}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
    return model.eval()


def _experts_complete(per_expert: dict[int, dict[str, object]], n: int) -> bool:
    """Whether one layer's routed experts are all read (w1, w2 and w3 of experts 0..n-1)."""
    return sorted(per_expert) == list(range(n)) and all(set(w) == {"w1", "w2", "w3"} for w in per_expert.values())


def _keep_fp4_experts(experts: torch.nn.Module, per_expert: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]], n: int, what: str) -> None:
    """Stack one layer's packed FP4 experts into ``experts.fp4`` (on its device) and free its bf16 weights."""
    if sorted(per_expert) != list(range(n)) or any(set(w) != {"w1", "w2", "w3"} for w in per_expert.values()):
        raise CheckpointError(f"{what} incomplete (need FP4 w1/w2/w3 for {n} experts)")
    device = experts.gate_up_proj.device
    rows = [per_expert[e] for e in range(n)]
    gate_up_q = torch.stack([torch.cat([w["w1"][0], w["w3"][0]]) for w in rows])  # (E, 2I, H/2)
    byte = lambda t: t.view(torch.uint8)  # noqa: E731 - cat/stack of e8m0 run on its bytes
    gate_up_s = torch.stack([torch.cat([byte(w["w1"][1]), byte(w["w3"][1])]) for w in rows]).view(torch.float8_e8m0fnu)  # (E, 2I, H/32)
    down_q = torch.stack([w["w2"][0] for w in rows])  # (E, H, I/2)
    down_s = torch.stack([byte(w["w2"][1]) for w in rows]).view(torch.float8_e8m0fnu)  # (E, H, I/32)
    e, two_i, h = experts.shape
    if gate_up_q.shape != (e, two_i, h // 2) or down_q.shape != (e, h, two_i // 4):
        raise CheckpointError(f"{what}: FP4 shapes {tuple(gate_up_q.shape)} / {tuple(down_q.shape)} do not fit ({e}, {two_i}, {h})")
    experts.fp4 = tuple(t.to(device).contiguous() for t in (gate_up_q, gate_up_s, down_q, down_s))
    empty = experts.gate_up_proj.new_empty(0)
    experts.gate_up_proj = torch.nn.Parameter(empty, requires_grad=False)
    experts.down_proj = torch.nn.Parameter(empty.clone(), requires_grad=False)


def _is_scale_of_some(key: str, keys: set[str]) -> bool:
    """Whether ``key`` is the quantization scale of another tensor in the same file."""
    for suffix, weight_suffix in ((".weight_scale_inv", ".weight"), ("_scale_inv", ""), (".scale", ".weight")):
        if key.endswith(suffix) and key[: -len(suffix)] + weight_suffix in keys:
            return True
    return False
