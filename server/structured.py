"""Structured output: the request fields that constrain an answer -> the engine's ``OutputConstraint``.

Sources, at most one per request (a second one is a 400 naming it):
- deepseek-recipe's constraint, from ``response_format`` (Chat), ``text.format`` (Responses) and
  ``tools`` / ``tool_choice``. The recipe decides whether there is one and of which kind; the
  schemas come from the client's body, not from the recipe's strict normalisation (which drops
  keywords: an integer ``enum``, ``minLength`` / ``maxLength``, ``minItems`` / ``maxItems``,
  ``uniqueItems``, ``minProperties``, ``patternProperties``, and top-level ``$defs`` while
  keeping the ``$ref``s into them). Each schema goes through ``deepserve.protocol.json_schema``: OpenAI's
  strict translation when ``strict: true``, and the audit that refuses what the grammar cannot
  enforce, so the answer always validates against what the client sent.
- vLLM: ``structured_outputs`` {``json``, ``regex``, ``choice``, ``grammar``, ``json_object``,
  ``disable_any_whitespace``, ``disable_additional_properties``, ``disable_fallback``} and the
  older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (with
  ``guided_decoding_backend``); SGLang: top-level ``regex`` / ``ebnf``. ``choice`` becomes an EBNF
  alternation of the exact strings; ``grammar`` / ``ebnf`` is xgrammar EBNF with a ``root`` rule.
  Refused with a 400 (the grammar cannot honour them): ``whitespace_pattern``,
  ``guided_whitespace_pattern``, ``structural_tag``, a backend other than xgrammar.

Compact JSON (no whitespace outside strings): the gateway's ``compact_json`` option, or a
request's ``disable_any_whitespace``. In thinking mode the grammar starts after ``</think>``.

deepseek-recipe's strict normalisation refuses schemas that OpenAI's strict mode accepts (``const``
/ ``enum`` without a ``type``, ``additionalProperties`` given as a schema, a ``format`` other than
five, ``items: false``, a one-branch ``allOf``, an ``anyOf`` of ``$ref``s) and its result is never
compiled. So the recipe converts a strict response schema as non-strict
(``with_non_strict_response_schema``: the prompt is the same, as the recipe renders the schema as
sent), and, when it refuses strict tools, the tools with their parameters already in OpenAI's
strict form (``with_strict_tools_translated``: the prompt shows that form, as the recipe's own).
Either way ``strict`` is read from the client's body here.

A forced tool choice in thinking mode (``tool_choice`` ``required`` or a named function; Messages:
``any`` / ``tool``), which the recipe refuses: the handler converts the request with an "auto"
choice instead (``with_auto_tool_choice``), and the constraint becomes ``tool_call_forced``: after
``</think>`` one whole tool-calls block, of the named tool when one is named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from deepserve.protocol.json_schema import SchemaError, enforceable_schema, strict_schema
from deepserve.protocol import ConstraintKind, OutputConstraint
from server.errors import InvalidRequest

VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
VLLM_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback", "whitespace_pattern")
LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
SGLANG = {"regex": "regex", "ebnf": "grammar"}
BACKENDS = ("xgrammar", "auto")


@dataclass(frozen=True)
class Requested:
    """One structured-output request from the body: where it came from, its kind and spec."""

    param: str
    kind: ConstraintKind
    spec: str


def recipe_constraint(
    body: dict[str, Any], recipe: Any, parsing_options: Any, thinking_end_id: int, *, compact: bool
) -> OutputConstraint | None:
    """The constraint of a Chat / Responses / Messages request: the recipe's (re-derived from the
    client's schemas) or an extension field's; 400 when both, or two extensions, are present."""
    ext = extension(body)
    if recipe is not None and ext is not None:
        other = "tools" if recipe.kind.startswith("tool_call") else "response_format"
        raise InvalidRequest(f"'{ext.param}' cannot be combined with a constraint from '{other}'.", param=ext.param)
    stage = parsing_options.thinking_initial_stage
    in_reasoning = stage is not None and stage.starts_in_reasoning() and not parsing_options.starts_in_tool_calls
    trigger = (thinking_end_id,) if in_reasoning else ()
    if ext is not None:
        return OutputConstraint(ext.kind, ext.spec, trigger, compact or _no_whitespace(body))
    if recipe is None:
        return None
    if recipe.kind == "json":
        spec = client_schema_spec(body) if recipe.schema else ""
        return OutputConstraint("json", recipe.schema if spec is None else spec, trigger, compact)
    if recipe.kind == "tool_call" and forced_tool(body) is not None:  # converted as "auto": see the docstring
        name = forced_tool(body) or None
        return OutputConstraint("tool_call_forced", client_tools_spec(body, recipe.schema, only=name), trigger, compact)
    if recipe.kind.startswith("tool_call"):
        return OutputConstraint(recipe.kind, client_tools_spec(body, recipe.schema), trigger, compact)
    return OutputConstraint(recipe.kind, recipe.schema, trigger, compact)


def completion_constraint(body: dict[str, Any], *, compact: bool) -> OutputConstraint | None:
    """The constraint of a ``/v1/completions`` request (no recipe there): an extension field or
    ``response_format`` (``text``, ``json_object``, ``json_schema``)."""
    ext = extension(body)
    fmt = body.get("response_format")
    fmt_kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is not None and fmt_kind not in ("text", "json_object", "json_schema"):
        raise InvalidRequest("'response_format.type' must be 'text', 'json_object' or 'json_schema'.", param="response_format.type")
    if fmt_kind in ("json_object", "json_schema") and ext is not None:
        raise InvalidRequest(f"'{ext.param}' cannot be combined with 'response_format'.", param=ext.param)
    if ext is not None:
        return OutputConstraint(ext.kind, ext.spec, (), compact or _no_whitespace(body))
    if fmt_kind == "json_object":
        return OutputConstraint("json", "", (), compact)
    if fmt_kind == "json_schema":
        spec = client_schema_spec(body)
        if spec is None:
            raise InvalidRequest("'response_format.json_schema.schema' is required.", param="response_format.json_schema")
        return OutputConstraint("json", spec, (), compact)
    return None


# ---- the client's schemas ---------------------------------------------------------------------------
def client_schema_spec(body: dict[str, Any]) -> str | None:
    """The enforceable spec of the response schema the client sent (Chat ``response_format``,
    Responses ``text.format``), or None when the body holds none."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and isinstance(fmt.get("json_schema"), dict) and "schema" in fmt["json_schema"]:
        box, param = fmt["json_schema"], "response_format.json_schema"
    else:
        text = body.get("text")
        box = text.get("format") if isinstance(text, dict) else None
        if not isinstance(box, dict) or "schema" not in box:
            return None
        param = "text.format"
    return schema_spec(box["schema"], strict=box.get("strict") is True, param=param + ".schema")


def client_tools_spec(body: dict[str, Any], recipe_spec: str, only: str | None = None) -> str:
    """The recipe's tool list (the tools the choice allows; ``only`` that one) with each tool's
    parameters replaced by the client's own, translated and audited (``tools[i].function.parameters``
    in errors)."""
    tools = json.loads(recipe_spec)
    if only is not None:
        tools = [t for t in tools if t.get("function", t).get("name") == only]
        if not tools:
            raise InvalidRequest(f"tool_choice names the function {only!r}, which is not in 'tools'.", param="tool_choice")
    sent = _tools_by_name(body)
    for tool in tools:
        fn = tool.get("function", tool)
        found = sent.get(fn.get("name"))
        if found is None:
            continue
        params, strict, param = found
        fn["parameters"] = json.loads(schema_spec(params, strict=strict, param=param))
    return json.dumps(tools, separators=(",", ":"), ensure_ascii=False)


def _tools_by_name(body: dict[str, Any]) -> dict[str, tuple[Any, bool, str]]:
    """name -> (parameters schema, strict, error param) for Chat, Responses and Messages tools."""
    out: dict[str, tuple[Any, bool, str]] = {}
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        if not isinstance(tool, dict):
            continue
        if isinstance(tool.get("function"), dict):  # Chat Completions
            fn, key, param = tool["function"], "parameters", f"tools[{i}].function.parameters"
        else:  # Responses (parameters) or Anthropic Messages (input_schema)
            fn = tool
            key = "input_schema" if "input_schema" in tool else "parameters"
            param = f"tools[{i}].{key}"
        if isinstance(fn.get("name"), str):
            params = fn.get(key)
            out[fn["name"]] = ({"type": "object", "properties": {}} if params is None else params, fn.get("strict") is True, param)
    return out


def forced_tool(body: dict[str, Any]) -> str | None:
    """``""`` when ``tool_choice`` requires some tool call, the function's name when it names one,
    else None (Chat, Responses and Messages spellings)."""
    choice = body.get("tool_choice")
    if choice == "required":
        return ""
    if not isinstance(choice, dict):
        return None
    kind = choice.get("type")
    if kind == "any":
        return ""
    fn = choice.get("function") if isinstance(choice.get("function"), dict) else choice
    name = fn.get("name")
    return name if kind in ("function", "tool") and isinstance(name, str) else None


def with_auto_tool_choice(body: dict[str, Any]) -> dict[str, Any] | None:
    """The body with its forced tool choice made "auto" (Messages: ``{"type": "auto"}``), or None
    when the choice is not forced."""
    if forced_tool(body) is None:
        return None
    anthropic = isinstance(body.get("tool_choice"), dict) and body["tool_choice"].get("type") in ("any", "tool")
    return {**body, "tool_choice": {"type": "auto"} if anthropic else "auto"}


def with_non_strict_response_schema(body: dict[str, Any]) -> dict[str, Any]:
    """The body with its strict response schema (Chat ``response_format.json_schema``, Responses
    ``text.format``) marked ``strict: false`` for deepseek-recipe; the same object when none is."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and isinstance(fmt.get("json_schema"), dict) and fmt["json_schema"].get("strict") is True:
        return {**body, "response_format": {**fmt, "json_schema": {**fmt["json_schema"], "strict": False}}}
    text = body.get("text")
    box = text.get("format") if isinstance(text, dict) else None
    if isinstance(box, dict) and box.get("strict") is True:
        return {**body, "text": {**text, "format": {**box, "strict": False}}}
    return body


def with_strict_tools_translated(body: dict[str, Any]) -> dict[str, Any] | None:
    """The body with each strict tool's parameters in OpenAI's strict form (``strict_schema``) and
    ``strict: false``, for deepseek-recipe; None when no tool is strict. A strict schema the
    grammar cannot enforce is a 400 naming the keyword (``schema_spec``)."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return None
    sent = _tools_by_name(body)
    out, changed = [], False
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) and isinstance(tool.get("function"), dict) else tool
        found = sent.get(fn.get("name")) if isinstance(fn, dict) else None
        if found is None or not found[1]:
            out.append(tool)
            continue
        params, _, param = found
        schema_spec(params, strict=True, param=param)
        key = param.rsplit(".", 1)[1]
        translated = {**fn, key: strict_schema(params), "strict": False}
        out.append({**tool, "function": translated} if fn is not tool else translated)
        changed = True
    return {**body, "tools": out} if changed else None


def schema_spec(schema: Any, *, strict: bool, param: str) -> str:
    """``deepserve.protocol.json_schema.enforceable_schema`` with its error as a 400 naming the keyword."""
    try:
        return enforceable_schema(schema, strict=strict)
    except SchemaError as exc:
        raise InvalidRequest(str(exc), param=f"{param}.{exc.location}" if exc.location else param) from None


# ---- vLLM / SGLang extensions ---------------------------------------------------------------------
def extension(body: dict[str, Any]) -> Requested | None:
    """The one structured-output extension field of the body, validated, or None."""
    found: list[Requested] = []
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidRequest("'structured_outputs' must be an object.", param="structured_outputs")
        for key, value in so.items():
            if key not in VLLM_KINDS and key not in VLLM_OPTIONS:
                raise InvalidRequest(f"Unknown structured_outputs field '{key}'.", param=f"structured_outputs.{key}")
            if value is None:
                continue
            if key == "whitespace_pattern" or key == "structural_tag":
                raise InvalidRequest(f"'structured_outputs.{key}' is not supported.", param=f"structured_outputs.{key}")
            if key in VLLM_OPTIONS:
                _boolean(value, f"structured_outputs.{key}")
            elif key != "json_object" or _boolean(value, "structured_outputs.json_object"):
                found.append(_requested(f"structured_outputs.{key}", key, value))
    for field, kind in (*LEGACY.items(), *SGLANG.items()):
        if body.get(field) is not None:
            found.append(_requested(field, kind, body[field]))
    if body.get("guided_whitespace_pattern") is not None:
        raise InvalidRequest("'guided_whitespace_pattern' is not supported.", param="guided_whitespace_pattern")
    backend = body.get("guided_decoding_backend")
    if backend is not None and (not isinstance(backend, str) or backend.split(":")[0] not in BACKENDS):
        raise InvalidRequest("The structured-output backend is xgrammar ('xgrammar' or 'auto').", param="guided_decoding_backend")
    if len(found) > 1:
        raise InvalidRequest(
            f"Only one kind of structured output per request: '{found[0].param}' and '{found[1].param}'.", param=found[1].param
        )
    return found[0] if found else None


def _requested(param: str, kind: str, value: Any) -> Requested:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise InvalidRequest(f"'{param}' is not valid JSON.", param=param) from None
        return Requested(param, "json", schema_spec(value, strict=False, param=param))
    if kind == "json_object":
        return Requested(param, "json", "")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequest(f"'{param}' must be a non-empty array of non-empty strings.", param=param)
        return Requested(param, "ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"'{param}' must be a non-empty string.", param=param)
    return Requested(param, "regex" if kind == "regex" else "ebnf", value)


def _boolean(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{param}' must be a boolean.", param=param)
    return value


def _no_whitespace(body: dict[str, Any]) -> bool:
    so = body.get("structured_outputs")
    return isinstance(so, dict) and so.get("disable_any_whitespace") is True
