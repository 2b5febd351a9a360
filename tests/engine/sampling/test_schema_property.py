"""Property test: random JSON schemas, constrained outputs, every output validated by ``jsonschema``.

Each random schema is drawn over the keyword set ``deepserve.protocol.json_schema`` supports, sometimes with
one keyword it refuses planted in it. For strict and non-strict mode: the schema is translated and
audited as the gateway does (a planted keyword must be refused, and only then), compiled with
xgrammar for the real DeepSeek V4 tokenizer, and sampled with random logits through the real
``Sampler`` (the ``bias`` of the structured tests nudges walks to end). Every finished output must
validate against the schema the client sent (and, in strict mode, against the strict translation:
every property present, no others). The default run draws a few schemas; ``-m slow`` many more.
"""

from __future__ import annotations

import datetime
import json
import random
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import pytest
import torch
from sampling_helpers import EOS, V4_VOCAB, run_to_end

from deepserve.protocol.json_schema import SchemaError, enforceable_schema
from deepserve.protocol import OutputConstraint, SamplingParams
from engine.sampling import InvalidConstraintError

PATTERNS = ["^[a-z]{1,6}$", "^[0-9]{2,4}-[A-Z]$", "^(?:ab|cd)$", "[xyz]", "^\\d+\\.?\\d{0,2}$", "^[a-f0-9]{8}$"]
FORMATS = ["email", "ipv4", "ipv6", "date", "uuid", "time", "date-time", "hostname", "duration"]
_DUR_TIME = r"T(?:\d+H(?:\d+M(?:\d+S)?)?|\d+M(?:\d+S)?|\d+S)"
DURATION = re.compile(rf"P(?:(?:\d+D|\d+M(?:\d+D)?|\d+Y(?:\d+M(?:\d+D)?)?)(?:{_DUR_TIME})?|{_DUR_TIME}|\d+W)")  # RFC 3339 Appendix A
WORDS = ["red", "green", "blue", "a b", 'q"uote', "ünï", ""]
# keyword -> a node that uses it in a way the grammar cannot enforce (the audit must refuse it)
PLANTS: dict[str, Any] = {
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "not": {"not": {"type": "string"}},
    "if": {"if": {"type": "integer"}, "then": {"minimum": 0}},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "allOf": {"allOf": [{"type": "integer"}, {"minimum": 2}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    "multipleOf": {"type": "integer", "minimum": 3, "multipleOf": 2},
    "minLength": {"type": "string", "pattern": "^a+$", "minLength": 2},
    "format": {"type": "string", "format": "uri"},
    "pattern": {"type": "string", "pattern": "^[a-z]+(-[a-z]+)*$"},
    "dependentRequired": {"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}},
}


@dataclass
class Drawn:
    """A random schema and what the audit must say about it."""

    schema: dict[str, Any]
    planted: str | None = None  # a keyword the audit must refuse in any mode
    strict_conflict: bool = False  # a 'required' subset or additionalProperties: true: strict mode refuses
    defs: dict[str, Any] = field(default_factory=dict)


class SchemaDraw:
    """Draws random schemas (``rng`` decides everything, so a seed reproduces a case)."""

    def __init__(self, rng: random.Random, plant_rate: float) -> None:
        self.rng = rng
        self.plant_rate = plant_rate
        self.drawn = Drawn({})

    def top(self) -> Drawn:
        self.drawn = Drawn({})
        schema = self.object(depth=0)
        if self.drawn.defs:
            schema["$defs"] = self.drawn.defs
        self.drawn.schema = schema
        return self.drawn

    def node(self, depth: int) -> Any:
        r = self.rng
        if self.drawn.planted is None and r.random() < self.plant_rate:
            self.drawn.planted = r.choice(sorted(PLANTS))
            return json.loads(json.dumps(PLANTS[self.drawn.planted]))
        kinds = ["integer", "number", "string", "boolean", "null", "enum", "const", "nullable"]
        if depth < 3:
            kinds += ["object", "array", "any_of", "one_of", "all_of", "ref"] * 2
        return getattr(self, r.choice(kinds))(depth)

    def integer(self, depth: int) -> dict[str, Any]:
        r, s = self.rng, {"type": "integer"}
        lo = r.randint(-50, 50)
        if r.random() < 0.5:
            s["exclusiveMinimum" if r.random() < 0.3 else "minimum"] = lo
        if r.random() < 0.5:
            s["exclusiveMaximum" if r.random() < 0.3 else "maximum"] = lo + r.randint(2, 500)
        return s

    def number(self, depth: int) -> dict[str, Any]:
        r, s = self.rng, {"type": "number"}
        lo = r.choice([-3.25, -1, 0, 0.5, 2, 10.75])
        if r.random() < 0.5:
            s["exclusiveMinimum" if r.random() < 0.3 else "minimum"] = lo
        if r.random() < 0.5:
            s["exclusiveMaximum" if r.random() < 0.3 else "maximum"] = lo + r.choice([0.5, 1, 7.5, 100])
        return s

    def string(self, depth: int) -> dict[str, Any]:
        r, s = self.rng, {"type": "string"}
        pick = r.random()
        if pick < 0.3:
            s["pattern"] = r.choice(PATTERNS)
        elif pick < 0.45:
            s["format"] = r.choice(FORMATS)
        else:
            if r.random() < 0.6:
                s["minLength"] = r.randint(0, 4)
            if r.random() < 0.8:
                s["maxLength"] = s.get("minLength", 0) + r.randint(0, 8)
        return s

    def boolean(self, depth: int) -> dict[str, Any]:
        return {"type": "boolean", "description": "a flag"}

    def null(self, depth: int) -> dict[str, Any]:
        return {"type": "null"}

    def enum(self, depth: int) -> dict[str, Any]:
        r = self.rng
        if r.random() < 0.4:  # pydantic's Literal[1, 2, 3]: the case strict normalisation broke
            return {"type": "integer", "enum": r.sample([1, 2, 3, 7, -4, 100], r.randint(1, 4))}
        if r.random() < 0.5:
            return {"type": "string", "enum": r.sample(WORDS, r.randint(1, 4))}
        return {"enum": r.sample([1, "one", None, True, 2.5, [1, 2], {"k": "v"}], r.randint(1, 4))}

    def const(self, depth: int) -> dict[str, Any]:
        return {"const": self.rng.choice([0, "fixed", False, None, {"a": [1]}, 3.5])}

    def nullable(self, depth: int) -> dict[str, Any]:
        inner = self.rng.choice([self.integer, self.string, self.number])(depth)
        inner["type"] = [inner["type"], "null"]
        inner.pop("format", None)
        return inner

    def object(self, depth: int) -> dict[str, Any]:
        r = self.rng
        names = r.sample(["id", "name", "count", "tags", "meta", "x", "y", "z"], r.randint(1 if depth == 0 else 0, 4))
        s: dict[str, Any] = {"type": "object", "properties": {n: self.node(depth + 1) for n in names}}
        pick = r.random()
        if pick < 0.35:
            s["required"] = list(names)
        elif pick < 0.7 and names:
            s["required"] = r.sample(names, r.randint(0, len(names) - 1))
            self.drawn.strict_conflict = True
        if names and r.random() < 0.2:
            s["minProperties"] = r.randint(0, len(names))
        if names and r.random() < 0.2:
            s["maxProperties"] = s.get("minProperties", 0) + r.randint(0, 2)
        pick = r.random()
        if pick < 0.4:
            s["additionalProperties"] = False
        elif pick < 0.5:
            s["additionalProperties"] = r.choice([True, {"type": "integer"}])
            self.drawn.strict_conflict |= s["additionalProperties"] is True  # strict keeps a schema
            if s.get("minProperties", 0) > len(s.get("required", ())):  # refused: extra keys may repeat
                del s["minProperties"]
        return s

    def array(self, depth: int) -> dict[str, Any]:
        r = self.rng
        s: dict[str, Any] = {"type": "array", "items": self.node(depth + 1)}
        if r.random() < 0.2:
            s["prefixItems"] = [self.node(depth + 1)]
        if r.random() < 0.5:
            s["minItems"] = r.randint(0, 2)
        if r.random() < 0.7:
            s["maxItems"] = s.get("minItems", 0) + r.randint(0, 3)
        return s

    def any_of(self, depth: int) -> dict[str, Any]:
        return {"anyOf": [self.node(depth + 1) for _ in range(self.rng.randint(1, 3))]}

    def one_of(self, depth: int) -> dict[str, Any]:
        kinds = self.rng.sample([self.integer, self.string, self.boolean, self.null], 2)
        return {"oneOf": [k(depth + 1) for k in kinds]}

    def all_of(self, depth: int) -> dict[str, Any]:
        return {"allOf": [self.node(depth + 1)], "description": "one branch"}

    def ref(self, depth: int) -> dict[str, Any]:
        name = f"D{len(self.drawn.defs)}"
        self.drawn.defs[name] = {}
        self.drawn.defs[name] = self.node(depth + 1)
        return {"$ref": f"#/$defs/{name}"}


@pytest.fixture(scope="module")
def bias(tokenizer) -> torch.Tensor:
    """Toward EOS and closing punctuation, away from whitespace-only tokens (as in the structured tests)."""
    b = torch.zeros(V4_VOCAB)
    b[[i for i in range(128000) if tokenizer.decode([i]).strip() == ""]] = -10.0
    b[EOS] = 5.0
    for text in ['"', '",', '"}', '"]', "}", "]", ',"', "null", "1", "0"]:
        (tid,) = tokenizer.encode(text).ids
        b[tid] += 9.0
    return b


def _formats() -> jsonschema.FormatChecker:
    """jsonschema's checks, plus the formats it checks only with optional packages (RFC 3339
    times through ``datetime``, RFC 1123 hostnames, absolute URIs)."""
    checker = jsonschema.FormatChecker()
    checker.checks("date-time", ValueError)(lambda v: not isinstance(v, str) or bool(datetime.datetime.fromisoformat(v).tzinfo))
    checker.checks("time", ValueError)(lambda v: not isinstance(v, str) or bool(datetime.time.fromisoformat(v).tzinfo))
    label = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
    checker.checks("hostname")(lambda v: not isinstance(v, str) or (len(v) <= 253 and all(label.fullmatch(x) for x in v.split("."))))
    checker.checks("duration")(lambda v: not isinstance(v, str) or bool(DURATION.fullmatch(v)))
    checker.checks("uri", ValueError)(lambda v: not isinstance(v, str) or bool(urllib.parse.urlsplit(v).scheme and " " not in v))
    return checker


def validator(schema: Any) -> jsonschema.Validator:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=_formats())


def check_schemas(n: int, seed: int, v4_sampler, grammars, tokenizer, bias, generations: int = 3) -> dict[str, int]:
    """Draw ``n`` schemas and check both modes of each; counts of what happened."""
    rng = random.Random(seed)
    draw = SchemaDraw(rng, plant_rate=0.08)
    counts = dict(refused=0, compiled=0, compile_errors=0, outputs=0, unfinished=0)
    for case in range(n):
        drawn = draw.top()
        for strict in (False, True):
            expect_refusal = drawn.planted is not None or (strict and drawn.strict_conflict)
            try:
                spec = enforceable_schema(drawn.schema, strict=strict)
            except SchemaError as exc:
                assert expect_refusal, f"case {case} strict={strict}: refused without cause at {exc.location}: {exc}\n{drawn.schema}"
                if not (strict and drawn.strict_conflict):  # else either refusal is right
                    assert exc.path[-1] == drawn.planted, (exc.location, drawn.planted)
                counts["refused"] += 1
                continue
            assert not expect_refusal, f"case {case} strict={strict}: {drawn.planted or 'strict conflict'} was not refused\n{drawn.schema}"
            constraint = OutputConstraint("json", spec, compact=rng.random() < 0.3)
            try:
                grammars.compile(constraint)
            except InvalidConstraintError:  # xgrammar refuses it too: a 400, never a wrong output
                counts["compile_errors"] += 1
                continue
            counts["compiled"] += 1
            checks = [validator(drawn.schema)] + ([validator(json.loads(spec))] if strict else [])
            params = [SamplingParams(max_tokens=160, seed=seed * 7919 + case * 31 + i, constraint=constraint) for i in range(generations)]
            states = [v4_sampler.new_state(p, [0]) for p in params]
            outputs = run_to_end(v4_sampler, states, seed=seed + case, max_steps=160, bias=bias)
            for state, tokens in zip(states, outputs):
                if state.finish_reason != "stop":
                    counts["unfinished"] += 1
                    continue
                assert tokens[-1] == EOS
                text = tokenizer.decode(tokens[:-1])
                value = json.loads(text)
                for check in checks:
                    errors = [e.message for e in check.iter_errors(value)]
                    assert not errors, f"case {case} strict={strict}: {text!r} violates the schema: {errors}\n{drawn.schema}"
                if constraint.compact:
                    assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", text)), f"whitespace outside strings: {text!r}"
                counts["outputs"] += 1
    return counts


def test_random_schemas_outputs_validate(v4_sampler, grammars, tokenizer, bias) -> None:
    counts = check_schemas(10, seed=1, v4_sampler=v4_sampler, grammars=grammars, tokenizer=tokenizer, bias=bias)
    print(counts)
    assert counts["compiled"] >= 8 and counts["outputs"] >= 12, counts


@pytest.mark.slow
def test_random_schemas_outputs_validate_long_run(v4_sampler, grammars, tokenizer, bias) -> None:
    counts = check_schemas(200, seed=2, v4_sampler=v4_sampler, grammars=grammars, tokenizer=tokenizer, bias=bias)
    print(counts)
    assert counts["outputs"] >= 300 and counts["refused"] >= 20, counts


OBJ = {"type": "object"}
# Strict schemas OpenAI accepts that deepseek-recipe's strict normalisation refuses (the gateway
# converts them as non-strict and compiles the client's own; see server.structured) or that need
# more than the common keywords: each must compile and every output validate.
OPENAI_STRICT: dict[str, dict[str, Any]] = {
    "const_without_type": {**OBJ, "properties": {"k": {"const": "a"}, "n": {"const": 3}, "o": {"const": {"x": [1, None]}}}},
    "enum_without_type": {**OBJ, "properties": {"k": {"enum": ["a", 1, None, True, 2.5, {"x": [1]}]}}},
    "recursive_tree": {
        **OBJ, "properties": {"root": {"$ref": "#/$defs/node"}},
        "$defs": {"node": {**OBJ, "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}}},
    },
    "linked_list": {
        **OBJ, "properties": {"head": {"$ref": "#/$defs/cell"}},
        "$defs": {"cell": {**OBJ, "properties": {"v": {"type": "string", "maxLength": 2}, "next": {"anyOf": [{"$ref": "#/$defs/cell"}, {"type": "null"}]}}}},
    },
    "ref_to_root": {**OBJ, "properties": {"v": {"type": "boolean"}, "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}}},
    "additional_properties_schema": {**OBJ, "properties": {"id": {"type": "integer"}}, "additionalProperties": {"type": "integer"}, "maxProperties": 2},
    "any_of_objects": {**OBJ, "properties": {"x": {"anyOf": [{**OBJ, "properties": {"a": {"type": "string"}}}, {**OBJ, "properties": {"b": {"type": "integer"}}}]}}},
    "any_of_refs_at_the_root": {
        "anyOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}],
        "$defs": {"A": {**OBJ, "properties": {"a": {"type": "string"}}}, "B": {**OBJ, "properties": {"b": {"type": "null"}}}},
    },
    "nested_defs": {
        **OBJ, "properties": {"a": {"$ref": "#/$defs/A"}},
        "$defs": {"A": {**OBJ, "properties": {"b": {"$ref": "#/$defs/A/$defs/B"}}, "$defs": {"B": {"type": "string", "enum": ["p", "q"]}}}},
    },
    "one_branch_all_of": {**OBJ, "properties": {"a": {"allOf": [{"$ref": "#/$defs/A"}]}}, "$defs": {"A": {"type": "integer", "minimum": 2, "maximum": 9}}},
    "pattern_and_formats": {
        **OBJ, "properties": {
            "p": {"type": "string", "pattern": "^[a-z]{2,4}$"}, "d": {"type": "string", "format": "date-time"},
            "t": {"type": "string", "format": "date"}, "u": {"type": "string", "format": "duration"},
        },
    },
    "array_bounds_and_prefix_items": {
        **OBJ, "properties": {
            "a": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
            "t": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 2}], "items": False},
        },
    },
    "discriminated_union": {
        **OBJ, "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}], "discriminator": {"propertyName": "kind"}}},
        "$defs": {
            "Cat": {**OBJ, "properties": {"kind": {"type": "string", "const": "cat"}, "lives": {"type": "integer"}}},
            "Dog": {**OBJ, "properties": {"kind": {"type": "string", "const": "dog"}, "good": {"type": "boolean"}}},
        },
    },
    "multiple_of": {
        **OBJ, "properties": {"a": {"type": "integer", "multipleOf": 7}, "b": {"type": "number", "multipleOf": 5, "minimum": -20, "maximum": 50}},
    },
    "nullable_types": {**OBJ, "properties": {"s": {"type": ["string", "null"]}, "o": {"type": ["object", "null"], "properties": {"a": {"type": "integer"}}}}},
}


@pytest.mark.parametrize("name", sorted(OPENAI_STRICT))
def test_openai_strict_schemas_outputs_validate(name, v4_sampler, grammars, tokenizer, bias) -> None:
    """Each output validates against the client's schema and its strict translation."""
    schema = OPENAI_STRICT[name]
    spec = enforceable_schema(schema, strict=True)
    constraint = OutputConstraint("json", spec)
    checks = [validator(schema), validator(json.loads(spec))]
    states = [v4_sampler.new_state(SamplingParams(max_tokens=200, seed=i, constraint=constraint), [0]) for i in range(4)]
    outputs = run_to_end(v4_sampler, states, seed=len(name), max_steps=200, bias=bias)
    finished = 0
    for state, tokens in zip(states, outputs):
        if state.finish_reason != "stop":
            continue
        value = json.loads(tokenizer.decode(tokens[:-1]))
        for check in checks:
            assert not [e.message for e in check.iter_errors(value)], (name, value)
        finished += 1
    assert finished >= 2, f"{name}: {finished} of 4 walks finished"
