"""deepserve.protocol.json_schema: OpenAI strict translation and the audit of what xgrammar enforces."""

from __future__ import annotations

import json
import re

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from deepserve.protocol.json_schema import SchemaError, enforceable_schema


def spec(schema, strict=False):
    return json.loads(enforceable_schema(schema, strict=strict))


def test_strict_keeps_the_integer_enum_and_spells_out_required_and_no_extras() -> None:
    schema = {"type": "object", "properties": {"count": {"type": "integer", "enum": [1, 2, 3]}}}
    assert spec(schema, strict=True) == {
        "type": "object",
        "properties": {"count": {"type": "integer", "enum": [1, 2, 3]}},
        "required": ["count"],
        "additionalProperties": False,
    }


def test_strict_reaches_nested_objects_and_keeps_defs() -> None:
    schema = {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}}, "maxItems": 2},
            "ref": {"$ref": "#/$defs/N"},
        },
        "$defs": {"N": {"type": "object", "properties": {"n": {"type": "integer"}}}},
    }
    out = spec(schema, strict=True)
    inner = out["properties"]["items"]["items"]
    assert inner["required"] == ["a"] and inner["additionalProperties"] is False
    assert inner["properties"]["a"]["maxLength"] == 3 and out["properties"]["items"]["maxItems"] == 2
    assert out["$defs"]["N"]["required"] == ["n"] and out["$defs"]["N"]["additionalProperties"] is False


def test_strict_keeps_an_additional_properties_schema() -> None:
    """OpenAI-style strict mode with extras the client allows: declared properties all required, the
    extras' schema kept as sent (vLLM and SGLang honour it)."""
    schema = {"type": "object", "properties": {"id": {"type": "integer"}}, "additionalProperties": {"type": "string"}}
    assert spec(schema, strict=True) == {**schema, "required": ["id"]}


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 2, "additionalProperties": {"type": "integer"}},
        {"type": "object", "properties": {}, "minProperties": 1, "additionalProperties": True},
    ],
)
def test_min_properties_met_by_extras_is_refused(schema) -> None:
    """xgrammar may repeat an extra key ({"x":1,"x":2}), which counts once once parsed."""
    with pytest.raises(SchemaError) as e:
        enforceable_schema(schema, strict=False)
    assert e.value.location == "minProperties"


def test_min_properties_met_by_declared_properties_passes() -> None:
    closed = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "minProperties": 1}
    assert spec(closed) == closed  # no extras: every key is a distinct declared one
    extras = {**closed, "required": ["a"], "additionalProperties": {"type": "integer"}}
    assert spec(extras) == extras  # the required property alone meets it
    strict = {**closed, "minProperties": 2, "additionalProperties": {"type": "integer"}}
    assert spec(strict, strict=True)["required"] == ["a", "b"]  # strict mode requires both


@pytest.mark.parametrize(
    "schema, location",
    [
        ({"type": "object", "properties": {"a": {"type": "string"}}, "required": []}, "required"),
        ({"type": "object", "properties": {}, "additionalProperties": True}, "additionalProperties"),
    ],
)
def test_strict_refuses_what_contradicts_it(schema, location) -> None:
    with pytest.raises(SchemaError) as e:
        enforceable_schema(schema, strict=True)
    assert e.value.location == location


@pytest.mark.parametrize(
    "schema, location",
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "properties": {"a": {"type": "array", "contains": {"type": "integer"}}}}, "properties.a.contains"),
        ({"not": {"type": "integer"}}, "not"),
        ({"if": {"type": "integer"}, "then": {"minimum": 1}}, "if"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
        ({"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}}, {"type": "object", "properties": {"k": {"const": "b"}}}]}, "oneOf"),
        ({"oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/A"}], "$defs": {"A": {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]}}}, "oneOf"),
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf"),
        ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
        ({"type": "integer", "multipleOf": 2, "minimum": 3}, "multipleOf"),
        ({"type": "integer", "multipleOf": 2000}, "multipleOf"),
        ({"type": "integer", "multipleOf": 2, "minimum": 0, "maximum": 5000}, "multipleOf"),
        ({"type": "integer", "multipleOf": 4, "minimum": 1, "maximum": 3}, "multipleOf"),
        ({"type": ["integer", "null"], "multipleOf": 4}, "multipleOf"),
        ({"multipleOf": 4}, "multipleOf"),
        ({"type": "string", "pattern": "^a+$", "minLength": 2}, "minLength"),
        ({"type": "string", "format": "iri"}, "format"),
        ({"type": "string", "pattern": "^(?:a*[0-9]{1,3})?$"}, "pattern"),
        ({"type": "string", "pattern": "^[a-z]+(-[a-z]+)*$"}, "pattern"),
        ({"type": "string", "pattern": "^(?=a)a$"}, "pattern"),
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, "required"),
        ({"type": "string", "const": 1}, "const"),
        ({"type": "string", "enum": ["a"], "maxLength": 0}, "maxLength"),
        ({"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/missing"}]}, "anyOf[1].$ref"),
        ({"$ref": "https://example.com/schema"}, "$ref"),
        ({"minLength": 3}, "minLength"),
        ({"type": "strng"}, "type"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ],
)
def test_refused_keywords_are_named(schema, location) -> None:
    with pytest.raises(SchemaError) as e:
        enforceable_schema(schema, strict=False)
    assert e.value.location == location


def test_formats_xgrammar_gets_wrong_become_stricter_patterns() -> None:
    out = spec({"type": "string", "format": "date", "description": "d"})
    assert "format" not in out and out["description"] == "d"
    assert re.fullmatch(out["pattern"][1:-1], "2024-02-28") and not re.fullmatch(out["pattern"][1:-1], "2021-02-30")
    with pytest.raises(SchemaError) as e:
        enforceable_schema({"type": "string", "format": "ipv4", "pattern": "^1"}, strict=False)
    assert e.value.location == "format"


def test_enum_values_the_type_rejects_are_dropped() -> None:
    assert spec({"type": "string", "enum": ["a", 1, None]}) == {"type": "string", "enum": ["a"]}
    assert spec({"type": ["integer", "null"], "enum": [1, 1.5, None, True]})["enum"] == [1, None]
    with pytest.raises(SchemaError, match="No 'enum' value"):
        enforceable_schema({"type": "boolean", "enum": [0, 1]}, strict=False)


def test_supported_schemas_pass_unchanged() -> None:
    schema = {
        "title": "T",
        "type": "object",
        "properties": {
            "s": {"type": "string", "minLength": 1, "maxLength": 5, "description": "d"},
            "p": {"type": "string", "pattern": "^[a-z]+$", "format": "email"},
            "n": {"type": "number", "minimum": 0, "exclusiveMaximum": 10},
            "u": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
            "a": {"allOf": [{"$ref": "#/definitions/A"}]},
            "t": {"type": "array", "prefixItems": [{"const": 1}], "items": False, "minItems": 1},
            "x-vendor": {"type": "null"},
        },
        "required": ["s"],
        "additionalProperties": {"type": "boolean"},
        "definitions": {"A": {"enum": [1, "a", None]}},
        "x-extension": 1,
    }
    assert spec(schema) == schema


@pytest.mark.parametrize(
    "schema, out",
    [
        ({"type": "integer", "multipleOf": 7}, {"type": "integer", "multipleOf": 7}),
        ({"type": "number", "multipleOf": 7}, {"type": "integer", "multipleOf": 7}),
        ({"type": "number", "multipleOf": 5, "minimum": -3, "exclusiveMaximum": 20.5}, {"type": "integer", "enum": [0, 5, 10, 15, 20]}),
        ({"type": "integer", "multipleOf": 3, "exclusiveMinimum": -7, "maximum": 3}, {"type": "integer", "enum": [-6, -3, 0, 3]}),
    ],
)
def test_integer_multiple_of_becomes_what_xgrammar_enforces(schema, out) -> None:
    """OpenAI strict mode supports ``multipleOf``; an integer one is kept alone or, between two
    bounds, spelled as the enum of its multiples (the same set of integers)."""
    assert spec(schema) == out


@pytest.mark.parametrize("m", [1, 3, 7, 100])
def test_xgrammar_multiple_of_alone_is_exact(m) -> None:
    grammar = xgr.Grammar.from_json_schema(enforceable_schema({"type": "integer", "multipleOf": m}, strict=False))
    for v in [*range(-40, 41), 5 * m, -9 * m, 123457 * m, 123457 * m + 1, 3 * m - 1]:
        assert _is_grammar_accept_string(grammar, str(v)) == (v % m == 0), v


def test_one_of_tagged_by_a_required_constant_passes() -> None:
    """A pydantic discriminated union, as the openai SDK's ``parse`` sends it: no value matches two
    branches, so xgrammar's ``anyOf`` reading of the ``oneOf`` is exact."""
    tagged = lambda tag, extra: {"type": "object", "properties": {"kind": {"type": "string", "const": tag}, **extra}, "required": ["kind", *extra]}
    schema = {
        "type": "object",
        "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}, {"type": "null"}], "discriminator": {"propertyName": "kind"}}},
        "$defs": {"Cat": tagged("cat", {"lives": {"type": "integer"}}), "Dog": tagged("dog", {"bark": {"type": "string"}})},
    }
    assert spec(schema) == schema
    assert spec(schema, strict=True)["$defs"]["Dog"]["additionalProperties"] is False
    enums = {"oneOf": [{**tagged("a", {}), "properties": {"kind": {"enum": ["a", "b"]}}}, tagged("c", {})]}
    assert spec(enums) == enums


@pytest.mark.parametrize("text, valid", [("P1D", True), ("PT1H30M", True), ("P1Y2M3DT4H5M6S", True), ("P2W", True), ("PT1H1S", False), ("P", False), ("PT", False), ("P1DT", False)])
def test_duration_format_is_an_rfc_3339_pattern(text, valid) -> None:
    """OpenAI strict mode supports ``format: duration``; xgrammar has no grammar for it."""
    out = spec({"type": "string", "format": "duration"}, strict=True)
    assert "format" not in out and bool(re.search(out["pattern"], text)) == valid
