"""``vllm bench serve``'s datasets: ``--dataset-name random`` and ``--dataset-name sharegpt``.

- ``random`` (vLLM's RandomDataset): each request's input length is drawn uniformly from
  ``[input_len * (1 - range_ratio), input_len * (1 + range_ratio)]``, its output length likewise
  from ``output_len``, and ``prefix_len`` tokens every request shares go first. The text comes
  from ``content.BlockContent`` (one DeepSeek token per word), so lengths are exact; the shared
  prefix is one content block (``block_size = prefix_len``), the rest is unique per request.
- ``sharegpt`` (vLLM's ShareGPTDataset): a JSON list of ``{"conversations": [{"from", "value"},
  ...]}`` the user supplies (nothing is downloaded). Conversations are shuffled with the seed; a
  request is the first turn as the prompt and the second turn's token count as the output length
  (or ``output_len`` when given). As vLLM does, pairs with fewer than 4 prompt tokens, fewer than
  4 output tokens (unless ``output_len`` is given), more than 1024 prompt tokens or more than 2048
  in all are skipped. Tokens are counted with the DeepSeek V4 tokenizer.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.workloads.synthetic import SHARED_ID_BASE
from bench.workloads.trace import TraceRow

MIN_TOKENS, MAX_PROMPT, MAX_TOTAL = 4, 1024, 2048  # vLLM's ShareGPT filter


@dataclass(frozen=True)
class RandomConfig:
    """vLLM's ``--random-input-len``, ``--random-output-len``, ``--random-prefix-len``, ``--random-range-ratio``."""

    input_len: int = 1024
    output_len: int = 128
    prefix_len: int = 0
    range_ratio: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1 or self.prefix_len < 0:
            raise ValueError("--random-input-len and --random-output-len must be >= 1, --random-prefix-len >= 0")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError("--random-range-ratio must be in [0, 1)")

    @property
    def block_size(self) -> int:
        """Content block size: the shared prefix is exactly one block."""
        return self.prefix_len or 512


def _uniform(rng: np.random.Generator, center: int, ratio: float, n: int) -> np.ndarray:
    low, high = max(1, int(center * (1 - ratio))), max(1, int(center * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)  # (n,) inclusive of both ends, as vLLM draws them


def random_rows(cfg: RandomConfig, num_requests: int) -> list[TraceRow]:
    """The requests of vLLM's random dataset as trace rows (see the module docstring)."""
    rng = np.random.default_rng(cfg.seed)
    ins = _uniform(rng, cfg.input_len, cfg.range_ratio, num_requests)
    outs = _uniform(rng, cfg.output_len, cfg.range_ratio, num_requests)
    bs = cfg.block_size
    rows, next_id = [], 0
    for i in range(num_requests):
        length = cfg.prefix_len + int(ins[i])
        shared = (SHARED_ID_BASE,) if cfg.prefix_len else ()
        own = -(-(length - cfg.prefix_len) // bs)
        rows.append(TraceRow(0.0, length, int(outs[i]), shared + tuple(range(next_id, next_id + own))))
        next_id += own
    return rows


def _turns(entry: Any) -> list[str] | None:
    convo = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(convo, list) or len(convo) < 2:
        return None
    texts = [t.get("value") for t in convo[:2] if isinstance(t, dict)]
    return texts if len(texts) == 2 and all(isinstance(t, str) for t in texts) else None


def sharegpt_requests(path: str | Path, num_requests: int, seed: int, output_len: int | None = None) -> list[tuple[str, int, int]]:
    """(prompt, prompt tokens, output tokens) of up to ``num_requests`` ShareGPT conversations."""
    import deepseek_recipe as dr

    from server.model import package_tokenizer_path

    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}} entries")
    tokenizer = dr.Tokenizer.from_file(str(package_tokenizer_path()))
    pairs = [t for t in map(_turns, data) if t is not None]
    random.Random(seed).shuffle(pairs)
    out: list[tuple[str, int, int]] = []
    for prompt, completion in pairs:
        if len(out) == num_requests:
            break
        n_in = len(tokenizer.encode(prompt))
        n_out = output_len if output_len is not None else len(tokenizer.encode(completion))
        if n_in < MIN_TOKENS or (output_len is None and n_out < MIN_TOKENS) or n_in > MAX_PROMPT or n_in + n_out > MAX_TOTAL:
            continue
        out.append((prompt, n_in, n_out))
    if not out:
        raise ValueError(f"{path}: no conversation passes the ShareGPT length filter")
    return out
