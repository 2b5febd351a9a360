"""Grammars for DeepSeek V4 tool calls (DSML markup), as xgrammar structural tags.

What the model writes, as deepseek-recipe renders an assistant turn with tool calls (V4)::

    {content}\\n\\n<｜DSML｜tool_calls>\\n
    <｜DSML｜invoke name="get_weather">\\n
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\\n
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\\n
    </｜DSML｜invoke>\\n
    </｜DSML｜tool_calls><｜end▁of▁sentence｜>

String arguments are raw text with ``string="true"``; every other value is JSON with
``string="false"``. V4.1 spells the tags ``<｜DSML｜ calls>``, ``<｜DSML｜ invoke`` and
``<｜DSML｜ parameter`` (a space after the DSML token).

Three constraint kinds (the first two are deepseek-recipe's ``OutputConstraint`` kinds):
- ``tool_call`` (tool_choice "auto"): free text (the content), then optionally one tool-calls
  block, then the end of the turn. deepseek-recipe's ``StreamProcessor`` treats any ``<｜DSML｜``
  in content as markup (a stray ``<｜DSML｜invoke`` becomes a tool call whose arguments no schema
  checked; other tags swallow the rest of the content), so in the grammar ``<｜DSML｜`` is the
  trigger of the tool-calls block: once written, the block must follow. It also drops
  ``</think>`` from content, so the free text excludes that string.
- ``tool_call_required`` (tool_choice "required" or a named function): the rendered prompt already
  ends with ``\\n\\n<｜DSML｜tool_calls>\\n`` (deepseek-recipe's ``starts_in_tool_calls`` parsing
  option), so the output is the continuation: one or more invokes, then the block's end tag.
- ``tool_call_forced`` (the same choices in thinking mode, where the recipe renders the prompt as
  for "auto" and the grammar starts after ``</think>``): the whole block, as an assistant turn with
  tool calls is rendered after its reasoning: ``\\n\\n<｜DSML｜tool_calls>\\n``, the invokes, the end
  tag.

Invoke arguments follow each tool's JSON schema in declared property order (xgrammar's
``deepseek_xml`` style: required properties present, optional ones optional, no unknown keys).
Both grammars are strict subsets of what the parser accepts: the parser also tolerates text after
the block, a missing end tag, and unknown tool names, which the grammars never produce.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import xgrammar as xgr
from xgrammar import structural_tag as st

from engine.sampling.errors import InvalidConstraintError

DsmlVersion = Literal["v4", "v4.1"]


@dataclass(frozen=True)
class DsmlSpelling:
    """How one model version spells the tool-call markup."""

    calls_begin: str  # opens the tool-calls block, newline included
    calls_end: str
    invoke_prefix: str  # followed by the tool name and INVOKE_SUFFIX
    invoke_end: str
    xml_style: str  # xgrammar JSONSchemaFormat style for the parameters
    dsml_token: str = "｜DSML｜"


INVOKE_SUFFIX = '">\n'
THINK_END = "</think>"

SPELLINGS: dict[DsmlVersion, DsmlSpelling] = {
    "v4": DsmlSpelling(
        calls_begin="<｜DSML｜tool_calls>\n",
        calls_end="</｜DSML｜tool_calls>",
        invoke_prefix='<｜DSML｜invoke name="',
        invoke_end="</｜DSML｜invoke>\n",
        xml_style="deepseek_xml",
    ),
    "v4.1": DsmlSpelling(
        calls_begin="<｜DSML｜ calls>\n",
        calls_end="</｜DSML｜ calls>",
        invoke_prefix='<｜DSML｜ invoke name="',
        invoke_end="</｜DSML｜ invoke>\n",
        xml_style="deepseek_v4_1_xml",
    ),
}


def parse_tools(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """``[(name, parameters schema)]`` from a Chat Completions tool list (a JSON array).

    Accepts ``{"type": "function", "function": {...}}`` items and bare ``{"name", "parameters"}``
    function objects; a tool without parameters takes no arguments.
    """
    try:
        tools = json.loads(spec) if spec else []
    except json.JSONDecodeError as e:
        raise InvalidConstraintError(f"tool list is not JSON: {e}") from e
    if not isinstance(tools, list):
        raise InvalidConstraintError("tool list must be a JSON array")
    out: list[tuple[str, dict[str, Any]]] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name or '"' in name:
            raise InvalidConstraintError(f"tools[{i}] has no valid function name")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise InvalidConstraintError(f"tools[{i}].function.parameters must be a JSON object")
        out.append((name, params))
    return out


def tool_call_structural_tag(
    spec: str, *, required: bool, version: DsmlVersion = "v4", max_whitespace: int | None = None, open_block: bool = False
) -> xgr.StructuralTag:
    """The structural tag for ``tool_call`` (``required=False``), ``tool_call_required`` or, with
    ``open_block``, ``tool_call_forced``; ``max_whitespace`` caps each run of whitespace inside the
    arguments (None: unbounded)."""
    sp = SPELLINGS[version]
    tools = parse_tools(spec)
    invokes = [
        st.TagFormat(
            begin=sp.invoke_prefix + name + INVOKE_SUFFIX,
            content=st.JSONSchemaFormat(json_schema=params, style=sp.xml_style, max_whitespace_cnt=max_whitespace),
            end=sp.invoke_end,
        )
        for name, params in tools
    ]
    if required:
        if not invokes:
            raise InvalidConstraintError("tool_call_required needs at least one tool")
        opening = [st.ConstStringFormat(value="\n\n" + sp.calls_begin)] if open_block else []
        fmt: Any = st.SequenceFormat(
            elements=[
                *opening,
                st.TagsWithSeparatorFormat(tags=invokes, separator="", at_least_one=True),
                st.ConstStringFormat(value=sp.calls_end),
            ]
        )
    elif not invokes:
        fmt = st.AnyTextFormat(excludes=["<" + sp.dsml_token, THINK_END])
    else:
        block = st.TagFormat(
            begin=sp.calls_begin,
            content=st.TagsWithSeparatorFormat(tags=invokes, separator="", at_least_one=True),
            end=sp.calls_end,
        )
        fmt = st.TriggeredTagsFormat(
            triggers=["<" + sp.dsml_token],
            tags=[block],
            excludes=[THINK_END],
            stop_after_first=True,  # the turn ends after one tool-calls block
        )
    return xgr.StructuralTag(format=fmt)
