"""Offline generation (what DeepInfer's offline example does): prompts in, JSON lines out."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from deepserve.protocol import GenerateRequest, SamplingParams
from engine.runtime.builder import build_engine, tokenizer_path
from engine.runtime.config import EngineConfig


def load_prompts(prompt: str | None, prompt_ids: str | None, input_file: str | None, tokenizer_json: Path) -> list[tuple[str | None, list[int]]]:
    """``(text or None, token ids)`` per prompt from exactly one of the three sources."""
    texts: list[str | None] = []
    ids: list[list[int]] = []
    if prompt_ids is not None:
        ids.append([int(t) for t in prompt_ids.split(",") if t.strip()])
        texts.append(None)
    elif prompt is not None:
        texts.append(prompt)
    elif input_file is not None:
        for line in Path(input_file).read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            if "prompt_ids" in row:
                ids.append([int(t) for t in row["prompt_ids"]])
                texts.append(None)
            else:
                texts.append(str(row["prompt"]))
    to_encode = [t for t in texts if t is not None]
    encoded: list[list[int]] = []
    if to_encode:
        from deepseek_recipe import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_json))
        encoded = [tok.encode(t) for t in to_encode]
    out, ei, ii = [], 0, 0
    for t in texts:
        if t is None:
            out.append((None, ids[ii]))
            ii += 1
        else:
            out.append((t, encoded[ei]))
            ei += 1
    return out


def generate(
    model_dir: str,
    prompts: list[tuple[str | None, list[int]]],
    sampling: SamplingParams,
    dtype: str = "auto",
    device: str = "cpu",
    load_format: str = "auto",
) -> Iterator[dict[str, Any]]:
    """Run all prompts through one engine (batched), yielding one result dict per prompt, in order
    (``load_format`` as ``EngineConfig.load_format``)."""
    cfg = EngineConfig(max_num_seqs=max(1, min(64, len(prompts))), max_num_batched_tokens=8192, load_format=load_format)  # type: ignore[arg-type]
    engine = build_engine(model_dir, cfg, dtype=dtype, device=device)
    start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for i, (_, ids) in enumerate(prompts):
        engine.add_request(GenerateRequest(str(i), ids, sampling))
        results[str(i)] = {"generated_ids": [], "logprobs": [], "top_logprobs": [], "first_token_s": None}
    while engine.has_work():
        for ev in engine.step():
            r = results[ev.request_id]
            if ev.token_ids and r["first_token_s"] is None:
                r["first_token_s"] = time.perf_counter() - start
            r["generated_ids"].extend(ev.token_ids)
            for lp in ev.logprobs or []:
                r["logprobs"].append(lp.logprob)
                r["top_logprobs"].append([[t, v] for t, v in lp.top])
            if ev.finished:
                r["finish_reason"] = ev.finish_reason
                r["total_s"] = time.perf_counter() - start
                if ev.error:
                    r["error"] = ev.error
    tok = None
    try:
        from deepseek_recipe import Tokenizer  # noqa: F401
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer.from_file(str(tokenizer_path(model_dir)))
    except Exception:  # decoding text is a convenience; ids are the result
        tok = None
    for i, (text, ids) in enumerate(prompts):
        r = results[str(i)]
        row = {"index": i, "prompt": text, "prompt_ids": ids, **r}
        row["text"] = tok.decode(r["generated_ids"], skip_special_tokens=False) if tok is not None else None
        if not sampling.logprobs:
            row.pop("logprobs")
            row.pop("top_logprobs")
        yield row


def write_results(rows: Iterator[dict[str, Any]], out: TextIO | None = None) -> None:
    """Each row as one JSON line on ``out`` (None: the current ``sys.stdout``, looked up at the call)."""
    out = sys.stdout if out is None else out
    for row in rows:
        out.write(json.dumps(row) + "\n")
        out.flush()
