"""End to end: structured output through the real `openai` SDK against a live `deepserve up`.

The tiny random model writes whatever the grammar allows, so these tests check that every answer
validates against the schema the client sent, that the extensions constrain, that unenforceable
schemas are refused with a 400 naming the keyword, and that a grammar slow to compile leaves other
requests alone.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.server.conftest import E2E_KEY, E2E_MODEL, engine_missing_reason

pytestmark = pytest.mark.skipif(engine_missing_reason() is not None, reason=engine_missing_reason() or "")

USER = [{"role": "user", "content": "Answer in JSON."}]
NO_THINK = {"thinking": {"type": "disabled"}}
COUNT = {"type": "object", "properties": {"count": {"type": "integer", "enum": [1, 2, 3]}}}


@pytest.fixture(scope="module")
def client(live_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_stack.url + "/v1", api_key=E2E_KEY, max_retries=0, timeout=300)


def test_strict_integer_enum_holds(client) -> None:
    """The issue's case: strict normalisation dropped the enum and a huge integer came back."""
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": COUNT, "strict": True}}
    for seed in range(4):
        r = client.chat.completions.create(
            model=E2E_MODEL, messages=USER, response_format=fmt, max_tokens=64, seed=seed, extra_body=NO_THINK
        )
        assert r.choices[0].finish_reason == "stop"
        value = json.loads(r.choices[0].message.content)
        jsonschema.validate(value, COUNT)
        assert set(value) == {"count"}  # strict: every property, nothing else


class Answer(pydantic.BaseModel):
    count: Literal[1, 2, 3]
    label: str = pydantic.Field(max_length=8)


def test_sdk_parse_with_a_pydantic_model(client) -> None:
    """``chat.completions.parse`` sends pydantic's strict schema and validates the answer."""
    for seed in range(3):
        r = client.chat.completions.parse(
            model=E2E_MODEL, messages=USER, response_format=Answer, max_tokens=96, seed=seed, extra_body=NO_THINK
        )
        assert isinstance(r.choices[0].message.parsed, Answer)


class Cat(pydantic.BaseModel):
    kind: Literal["cat"]
    lives: int


class Dog(pydantic.BaseModel):
    kind: Literal["dog"]
    good: bool


class Pet(pydantic.BaseModel):
    pet: Cat | Dog = pydantic.Field(discriminator="kind")


def test_sdk_parse_with_a_discriminated_union(client) -> None:
    """pydantic writes a tagged union as ``oneOf``; its branches never overlap, so it is enforced."""
    for seed in range(2):
        r = client.chat.completions.parse(
            model=E2E_MODEL, messages=USER, response_format=Pet, max_tokens=64, seed=seed, extra_body=NO_THINK
        )
        assert isinstance(r.choices[0].message.parsed, Pet)


def test_vllm_and_sglang_extensions_constrain(client) -> None:
    r = client.chat.completions.create(
        model=E2E_MODEL, messages=USER, max_tokens=16, seed=1, extra_body={"guided_choice": ["yes", "no"], **NO_THINK}
    )
    assert r.choices[0].message.content in ("yes", "no")
    r = client.chat.completions.create(
        model=E2E_MODEL, messages=USER, max_tokens=64, seed=2,
        extra_body={"structured_outputs": {"json": COUNT, "disable_any_whitespace": True}, **NO_THINK},
    )
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), COUNT)
    assert " " not in text and "\n" not in text
    r = client.completions.create(model=E2E_MODEL, prompt="id:", max_tokens=16, seed=3, extra_body={"regex": "[A-F]{4}"})
    assert len(r.choices[0].text) == 4 and set(r.choices[0].text) <= set("ABCDEF")


def test_guided_json_in_thinking_mode_applies_after_the_reasoning(client) -> None:
    r = client.chat.completions.create(
        model=E2E_MODEL, messages=USER, max_tokens=200, seed=5, extra_body={"guided_json": COUNT, "thinking": {"type": "enabled"}}
    )
    msg = r.choices[0].message
    assert isinstance(msg.model_extra.get("reasoning_content"), str)
    if r.choices[0].finish_reason == "stop":  # the answer after </think> follows the schema
        jsonschema.validate(json.loads(msg.content), COUNT)


def test_unenforceable_schema_is_400_naming_the_keyword(client) -> None:
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=E2E_MODEL, messages=USER, response_format=fmt, max_tokens=8, extra_body=NO_THINK)
    assert e.value.body["param"] == "response_format.json_schema.schema.properties.tags.uniqueItems"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=E2E_MODEL, messages=USER, max_tokens=8, extra_body={"guided_regex": "a", "guided_choice": ["b"]})
    assert e.value.body["param"] == "guided_choice"


OBJ = {"type": "object"}
# Strict schemas OpenAI accepts that deepseek-recipe's strict normalisation refuses.
STRICT_ACCEPTED = {
    "typeless_const_and_enum": {**OBJ, "properties": {"k": {"const": "a"}, "e": {"enum": ["x", 1, None]}}},
    "recursive_list": {
        **OBJ, "properties": {"head": {"$ref": "#/$defs/cell"}},
        "$defs": {"cell": {**OBJ, "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}, "next": {"anyOf": [{"$ref": "#/$defs/cell"}, {"type": "null"}]}}}},
    },
    "additional_properties_schema": {**OBJ, "properties": {"id": {"const": 7}}, "additionalProperties": {"type": "boolean"}, "maxProperties": 2},
    "format_and_prefix_items": {
        **OBJ, "properties": {
            "d": {"type": "string", "format": "date"},
            "t": {"type": "array", "prefixItems": [{"enum": [1, 2]}, {"type": "boolean"}], "items": False},
        },
    },
}


@pytest.mark.parametrize("name", sorted(STRICT_ACCEPTED))
def test_strict_schemas_the_recipe_refuses_are_honoured(client, name) -> None:
    """Each answer validates against the client's schema, every property present (strict)."""
    schema = STRICT_ACCEPTED[name]
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    finished = 0
    for seed in range(2):
        r = client.chat.completions.create(
            model=E2E_MODEL, messages=USER, response_format=fmt, max_tokens=96, seed=seed, extra_body=NO_THINK
        )
        if r.choices[0].finish_reason != "stop":
            continue
        value = json.loads(r.choices[0].message.content)
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
        assert set(schema["properties"]) <= set(value)
        finished += 1
    assert finished, f"{name}: no answer finished"


def test_responses_strict_text_format_the_recipe_refuses_is_honoured(client) -> None:
    schema = STRICT_ACCEPTED["typeless_const_and_enum"]
    fmt = {"format": {"type": "json_schema", "name": "s", "schema": schema, "strict": True}}
    r = client.responses.create(
        model=E2E_MODEL, input="Answer in JSON.", text=fmt, max_output_tokens=96, store=False, extra_body={"reasoning": {"max_tokens": 2}}
    )
    value = json.loads(r.output_text)
    jsonschema.validate(value, schema)
    assert set(value) == {"k", "e"}


def test_strict_tool_the_recipe_refuses_is_honoured(client) -> None:
    params = {**OBJ, "properties": {"mode": {"enum": ["fast", 2]}}}
    tools = [{"type": "function", "function": {"name": "go", "strict": True, "parameters": params}}]
    finished = 0
    for seed in range(2):
        r = client.chat.completions.create(
            model=E2E_MODEL, messages=USER, tools=tools, tool_choice="required", max_tokens=200, seed=seed, extra_body=NO_THINK
        )
        if r.choices[0].finish_reason != "tool_calls":
            continue
        for call in r.choices[0].message.tool_calls:
            args = json.loads(call.function.arguments)
            jsonschema.validate(args, params)
            assert set(args) == {"mode"}
        finished += 1
    assert finished, "no tool call finished"
    bad = {**OBJ, "properties": {}, "additionalProperties": True}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": bad, "strict": True}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=E2E_MODEL, messages=USER, response_format=fmt, max_tokens=8, extra_body=NO_THINK)
    assert e.value.body["param"] == "response_format.json_schema.schema.additionalProperties"


@pytest.mark.slow  # ~10 s: the hostile request fails at the engine's grammar_timeout_s
def test_slow_grammar_does_not_stall_a_concurrent_chat(client) -> None:
    """Issue 21: a 16,000-repeat pattern froze every stream of its worker while it compiled."""
    hostile = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "string", "pattern": "[a-z]{16000}"}}}
    client.chat.completions.create(model=E2E_MODEL, messages=USER, max_tokens=4, extra_body=NO_THINK)  # warm
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        slow = pool.submit(
            client.chat.completions.create, model=E2E_MODEL, messages=USER, response_format=hostile, max_tokens=8, extra_body=NO_THINK
        )
        time.sleep(0.5)  # the hostile grammar is compiling
        t0 = time.perf_counter()
        r = client.chat.completions.create(model=E2E_MODEL, messages=USER, max_tokens=4, extra_body=NO_THINK)
        took = time.perf_counter() - t0
        assert r.choices[0].finish_reason in ("stop", "length")
        assert took < 2.0, f"a short chat took {took:.1f}s beside a compiling grammar"
        with pytest.raises(openai.BadRequestError) as e:
            slow.result(timeout=120)
    assert "did not compile" in e.value.message


TOOLS = [
    {"type": "function", "function": {"name": "count", "parameters": COUNT}},
    {"type": "function", "function": {"name": "echo", "parameters": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}}}},
]
THINK_END_BIAS = {"128822": 100}  # </think> at once: the random model would think for ever


@pytest.mark.parametrize("choice, names", [("required", {"count", "echo"}), ({"type": "function", "function": {"name": "count"}}, {"count"})])
def test_forced_tool_choice_in_thinking_mode(client, choice, names) -> None:
    """deepseek-recipe refuses these in thinking mode; the grammar forces the call after </think>."""
    for seed in range(3):
        r = client.chat.completions.create(
            model=E2E_MODEL, messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=160, seed=seed,
            logit_bias=THINK_END_BIAS, extra_body={"thinking": {"type": "enabled"}},
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        for call in c.message.tool_calls:
            assert call.function.name in names
            schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), schema)
