"""server.structured: request fields -> OutputConstraint, over real deepseek-recipe conversions."""

from __future__ import annotations

import json
from typing import Any

import deepseek_recipe as dr
import pytest

from server.errors import InvalidRequest
from deepserve.protocol.json_schema import enforceable_schema
from server.structured import (
    completion_constraint,
    forced_tool,
    recipe_constraint,
    with_auto_tool_choice,
    with_non_strict_response_schema,
    with_strict_tools_translated,
)

MODEL = "DeepSeek-V4-Pro"
THINK_END = 128822
USER = [{"role": "user", "content": "Answer in json."}]
NO_THINK = {"thinking": {"type": "disabled"}}
COUNT = {"type": "object", "properties": {"count": {"type": "integer", "enum": [1, 2, 3]}}}


def constraint(body: dict[str, Any], cls: Any = dr.ChatCompletionRequest, compact: bool = False):
    body = {"model": MODEL, **body}
    conv = cls(json.dumps(body).encode()).convert(dr.ConversionOptions())
    return recipe_constraint(body, conv.inference_options.output_constraint, conv.parsing_options, THINK_END, compact=compact)


def refused(body: dict[str, Any], cls: Any = dr.ChatCompletionRequest) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        constraint(body, cls)
    return e.value


def test_strict_json_schema_keeps_the_integer_enum() -> None:
    """The recipe's strict normalisation drops the enum; the constraint is the client's schema."""
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": COUNT, "strict": True}}
    c = constraint({"messages": USER, "response_format": fmt, **NO_THINK})
    assert c.kind == "json" and c.trigger_token_ids == ()
    assert json.loads(c.spec) == {**COUNT, "required": ["count"], "additionalProperties": False}


OBJ = {"type": "object"}
# Strict schemas OpenAI accepts and deepseek-recipe's strict normalisation refuses (each one is
# checked to still be refused by it, so a recipe that starts accepting one shows here).
RECIPE_REFUSES_STRICT = {
    "const_without_type": {**OBJ, "properties": {"k": {"const": "a"}}},
    "enum_without_type": {**OBJ, "properties": {"k": {"enum": ["a", 1, None]}}},
    "additional_properties_schema": {**OBJ, "properties": {"id": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
    "format_date_time": {**OBJ, "properties": {"d": {"type": "string", "format": "date-time"}}},
    "prefix_items": {**OBJ, "properties": {"t": {"type": "array", "prefixItems": [{"type": "integer"}], "items": False}}},
    "one_branch_all_of": {**OBJ, "properties": {"a": {"allOf": [{"$ref": "#/$defs/A"}]}}, "$defs": {"A": {"type": "string"}}},
    "any_of_refs": {"anyOf": [{"$ref": "#/$defs/A"}], "$defs": {"A": {**OBJ, "properties": {"a": {"type": "string"}}}}},
}


def _prompt(body: dict[str, Any]) -> str:
    conv = dr.ChatCompletionRequest(json.dumps({"model": MODEL, **body}).encode()).convert(dr.ConversionOptions())
    return dr.DeepseekV4Encoding().render_conversation(conv.conversation).prompt


@pytest.mark.parametrize("name", sorted(RECIPE_REFUSES_STRICT))
def test_strict_response_schema_the_recipe_refuses_is_converted_non_strict(name) -> None:
    """The recipe converts it as non-strict; the constraint is the client's schema in strict form."""
    schema = RECIPE_REFUSES_STRICT[name]
    body = {"model": MODEL, "messages": USER, **NO_THINK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}}
    with pytest.raises(dr.ConversionError):
        dr.ChatCompletionRequest(json.dumps(body).encode()).convert(dr.ConversionOptions())
    lenient = with_non_strict_response_schema(body)
    assert lenient["response_format"]["json_schema"]["strict"] is False and body["response_format"]["json_schema"]["strict"] is True
    conv = dr.ChatCompletionRequest(json.dumps(lenient).encode()).convert(dr.ConversionOptions())
    c = recipe_constraint(body, conv.inference_options.output_constraint, conv.parsing_options, THINK_END, compact=False)
    assert c.spec == enforceable_schema(schema, strict=True)


def test_non_strict_response_schema_renders_the_same_prompt() -> None:
    """The recipe renders the schema as sent: ``strict`` never reaches the prompt."""
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": COUNT, "strict": True}}
    body = {"messages": USER, "response_format": fmt, **NO_THINK}
    assert _prompt(with_non_strict_response_schema(body)) == _prompt(body)
    text = {"format": {"type": "json_schema", "name": "c", "schema": RECIPE_REFUSES_STRICT["const_without_type"], "strict": True}}
    lenient = with_non_strict_response_schema({"input": "json", "text": text})
    assert lenient["text"]["format"]["strict"] is False
    conv = dr.ResponsesRequest(json.dumps({"model": MODEL, **lenient}).encode()).convert(dr.ConversionOptions())
    c = recipe_constraint({"input": "json", "text": text}, conv.inference_options.output_constraint, conv.parsing_options, THINK_END, compact=False)
    assert json.loads(c.spec)["required"] == ["k"]
    assert with_non_strict_response_schema(body | {"response_format": {"type": "json_object"}})["response_format"] == {"type": "json_object"}


def test_strict_tools_the_recipe_refuses_are_translated_for_it() -> None:
    params = RECIPE_REFUSES_STRICT["const_without_type"]
    tools = [
        {"type": "function", "function": {"name": "f", "strict": True, "parameters": params}},
        {"type": "function", "function": {"name": "g", "parameters": params}},
    ]
    body = {"model": MODEL, "messages": USER, "tools": tools, **NO_THINK}
    with pytest.raises(dr.ConversionError):
        dr.ChatCompletionRequest(json.dumps(body).encode()).convert(dr.ConversionOptions())
    translated = with_strict_tools_translated(body)
    f, g = (t["function"] for t in translated["tools"])
    assert f["strict"] is False and f["parameters"] == {**params, "required": ["k"], "additionalProperties": False}
    assert g == tools[1]["function"]
    conv = dr.ChatCompletionRequest(json.dumps(translated).encode()).convert(dr.ConversionOptions())
    c = recipe_constraint(body, conv.inference_options.output_constraint, conv.parsing_options, THINK_END, compact=False)
    assert [t["function"]["parameters"] for t in json.loads(c.spec)] == [f["parameters"], params]
    responses = {"input": "x", "tools": [{"type": "function", "name": "f", "strict": True, "parameters": params}]}
    assert with_strict_tools_translated(responses)["tools"][0]["parameters"]["required"] == ["k"]
    assert with_strict_tools_translated({"messages": USER, "tools": tools[1:]}) is None


def test_unenforceable_strict_tool_is_a_400_naming_the_keyword() -> None:
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {**OBJ, "properties": {"a": {"not": {}}}}}}]
    with pytest.raises(InvalidRequest) as e:
        with_strict_tools_translated({"messages": USER, "tools": tools})
    assert e.value.param == "tools[0].function.parameters.properties.a.not"


def test_responses_text_format_keeps_the_enum_and_thinking_triggers() -> None:
    fmt = {"format": {"type": "json_schema", "name": "c", "schema": COUNT, "strict": True}}
    c = constraint({"input": "json please", "text": fmt}, dr.ResponsesRequest)
    assert json.loads(c.spec)["properties"]["count"]["enum"] == [1, 2, 3]
    assert c.trigger_token_ids == (THINK_END,)


def test_unenforceable_keyword_is_a_400_naming_it() -> None:
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    e = refused({"messages": USER, "response_format": fmt})
    assert e.status == 400 and e.param == "response_format.json_schema.schema.properties.tags.uniqueItems"


def test_strict_tool_parameters_come_from_the_client() -> None:
    tools = [
        {"type": "function", "function": {"name": "f", "strict": True, "parameters": COUNT}},
        {"type": "function", "function": {"name": "g", "strict": True, "parameters": {"type": "object", "properties": {}}}},
    ]
    c = constraint({"messages": USER, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}, **NO_THINK})
    assert c.kind == "tool_call_required"
    (tool,) = json.loads(c.spec)
    assert tool["function"]["name"] == "f"
    assert tool["function"]["parameters"]["properties"]["count"]["enum"] == [1, 2, 3]
    assert tool["function"]["parameters"]["required"] == ["count"]


def test_tool_parameters_audited_with_the_tool_index() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"not": {}}}}}}]
    e = refused({"messages": USER, "tools": tools, **NO_THINK})
    assert e.param == "tools[0].function.parameters.properties.a.not"


@pytest.mark.parametrize(
    "fields, kind, spec",
    [
        ({"guided_json": COUNT}, "json", json.dumps(COUNT, separators=(",", ":"))),
        ({"guided_json": json.dumps(COUNT)}, "json", json.dumps(COUNT, separators=(",", ":"))),
        ({"guided_regex": "[0-9]{3}"}, "regex", "[0-9]{3}"),
        ({"guided_choice": ["yes", 'no "way"']}, "ebnf", 'root ::= "yes" | "no \\"way\\""'),
        ({"guided_grammar": 'root ::= "a"'}, "ebnf", 'root ::= "a"'),
        ({"structured_outputs": {"json": COUNT}}, "json", json.dumps(COUNT, separators=(",", ":"))),
        ({"structured_outputs": {"regex": "a+"}}, "regex", "a+"),
        ({"structured_outputs": {"choice": ["x"]}}, "ebnf", 'root ::= "x"'),
        ({"structured_outputs": {"grammar": 'root ::= "b"'}}, "ebnf", 'root ::= "b"'),
        ({"structured_outputs": {"json_object": True}}, "json", ""),
        ({"regex": "b+", "guided_decoding_backend": "xgrammar"}, "regex", "b+"),
        ({"ebnf": 'root ::= "c"'}, "ebnf", 'root ::= "c"'),
    ],
)
def test_extensions_map_to_constraints(fields, kind, spec) -> None:
    c = constraint({"messages": USER, **fields, **NO_THINK})
    assert (c.kind, c.spec, c.compact) == (kind, spec, False)


def test_extension_in_thinking_mode_starts_after_think_end() -> None:
    c = constraint({"messages": USER, "guided_regex": "a"})
    assert c.trigger_token_ids == (THINK_END,)


def test_compact_from_the_server_option_or_the_request() -> None:
    assert constraint({"messages": USER, "guided_json": COUNT, **NO_THINK}, compact=True).compact
    so = {"json": COUNT, "disable_any_whitespace": True}
    assert constraint({"messages": USER, "structured_outputs": so, **NO_THINK}).compact
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": COUNT}}
    assert constraint({"messages": USER, "response_format": fmt, **NO_THINK}, compact=True).compact


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"guided_json": COUNT, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
        ({"structured_outputs": {"disable_any_whitespace": "yes"}}, "structured_outputs.disable_any_whitespace"),
        ({"structured_outputs": "json"}, "structured_outputs"),
        ({"guided_whitespace_pattern": "\\s*"}, "guided_whitespace_pattern"),
        ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json.uniqueItems"),
        ({"regex": 3}, "regex"),
    ],
)
def test_bad_extensions_are_400_with_param(fields, param) -> None:
    assert refused({"messages": USER, **fields, **NO_THINK}).param == param


def test_extension_with_response_format_is_refused() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": COUNT}}
    assert refused({"messages": USER, "response_format": fmt, "guided_regex": "a", **NO_THINK}).param == "guided_regex"


def test_completions_constraints() -> None:
    assert completion_constraint({"prompt": "x"}, compact=False) is None
    assert completion_constraint({"response_format": {"type": "text"}}, compact=False) is None
    c = completion_constraint({"response_format": {"type": "json_schema", "json_schema": {"schema": COUNT, "strict": True}}}, compact=True)
    assert c.compact and json.loads(c.spec)["required"] == ["count"]
    assert completion_constraint({"response_format": {"type": "json_object"}}, compact=False).spec == ""
    assert completion_constraint({"guided_choice": ["a", "b"]}, compact=False).kind == "ebnf"
    with pytest.raises(InvalidRequest) as e:
        completion_constraint({"response_format": {"type": "xml"}}, compact=False)
    assert e.value.param == "response_format.type"


TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": COUNT}},
    {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {"s": {"type": "string"}}}}},
]


@pytest.mark.parametrize("choice, names", [("required", ["f", "g"]), ({"type": "function", "function": {"name": "g"}}, ["g"])])
def test_forced_tool_choice_in_thinking_mode(choice, names) -> None:
    """The recipe refuses it; converted as "auto", the grammar forces the block after </think>."""
    body = {"messages": USER, "tools": TOOLS, "tool_choice": choice}
    with pytest.raises(dr.ConversionError):
        constraint(body)
    auto = with_auto_tool_choice({"model": MODEL, **body})
    assert auto["tool_choice"] == "auto" and auto["tools"] == TOOLS
    conv = dr.ChatCompletionRequest(json.dumps(auto).encode()).convert(dr.ConversionOptions())
    assert conv.conversation.thinking_mode
    c = recipe_constraint(auto | {"tool_choice": choice}, conv.inference_options.output_constraint, conv.parsing_options, THINK_END, compact=False)
    assert c.kind == "tool_call_forced" and c.trigger_token_ids == (THINK_END,)
    assert [t["function"]["name"] for t in json.loads(c.spec)] == names


def test_forced_tool_spellings() -> None:
    assert forced_tool({"tool_choice": "required"}) == ""
    assert forced_tool({"tool_choice": {"type": "function", "name": "r"}}) == "r"  # Responses
    assert forced_tool({"tool_choice": {"type": "any"}}) == ""  # Messages
    assert forced_tool({"tool_choice": {"type": "tool", "name": "m"}}) == "m"
    assert forced_tool({"tool_choice": "auto"}) is None and forced_tool({}) is None
    assert with_auto_tool_choice({"tool_choice": {"type": "tool", "name": "m"}}) == {"tool_choice": {"type": "auto"}}
    assert with_auto_tool_choice({"tool_choice": "none"}) is None
