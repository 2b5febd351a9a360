"""Structured output through the whole engine: the random tiny model still emits valid output."""

from __future__ import annotations

import json
import re

import jsonschema

from deepserve.protocol import GenerateRequest, OutputConstraint, SamplingParams
from engine.runtime.builder import build_engine
from engine.runtime.config import EngineConfig
from tests.engine.runtime.helpers import prompt, run

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["color", "count", "ok"],
    "additionalProperties": False,
}


def _texts(engine, model_dir, constraint: OutputConstraint, n: int, max_tokens: int = 96) -> list[str]:
    from tokenizers import Tokenizer

    from engine.runtime.builder import tokenizer_path

    reqs = [
        GenerateRequest(f"s{i}", prompt(20 + i, 1000 + i), SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, constraint=constraint))
        for i in range(n)
    ]
    out = run(engine, reqs)
    tok = Tokenizer.from_file(str(tokenizer_path(model_dir)))
    eos = set(engine.model.config.eos_token_ids)
    texts = []
    for r in reqs:
        res = out[r.request_id]
        assert res.finish_reason == "stop", (res.finish_reason, res.tokens)
        texts.append(tok.decode([t for t in res.tokens if t not in eos], skip_special_tokens=False))
    return texts


def _engine(tiny_model, tiny_model_dir):
    return build_engine(tiny_model_dir, EngineConfig(max_num_seqs=64, max_num_batched_tokens=4096), model=tiny_model)


def test_fifty_json_schema_generations_validate(tiny_model, tiny_model_dir) -> None:
    texts = _texts(_engine(tiny_model, tiny_model_dir), tiny_model_dir, OutputConstraint("json", json.dumps(SCHEMA)), 50, max_tokens=200)
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_and_ebnf_generations_match(tiny_model, tiny_model_dir) -> None:
    engine = _engine(tiny_model, tiny_model_dir)
    pattern = r"[A-Z]{2}-[0-9]{3}"
    for text in _texts(engine, tiny_model_dir, OutputConstraint("regex", pattern), 20, max_tokens=24):
        assert re.fullmatch(pattern, text), text
    grammar = 'root ::= "answer=" ("yes" | "no") ";level=" [1-3]'
    for text in _texts(engine, tiny_model_dir, OutputConstraint("ebnf", grammar), 20, max_tokens=24):
        assert re.fullmatch(r"answer=(yes|no);level=[1-3]", text), text
