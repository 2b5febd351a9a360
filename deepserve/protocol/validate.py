"""Typed checks of the internal wire messages where they enter a process.

``GenerateRequest.from_dict`` trusts its input's types; a wrong one (``sampling.seed: "x"``,
``top_k: 1e20``, a constraint ``spec`` that is an object) used to surface deep in the engine
thread. ``check_generate`` walks the decoded JSON against the dataclasses' own annotations
(``deepserve/protocol/messages.py``), so a field added there is checked here without an edit, and raises a
``ValueError`` naming the field. The dataclasses' ``__post_init__`` still check value ranges.

Accepted per annotation: ``int`` (a JSON integer, not a boolean, within int64), ``float`` (a
JSON number, finite), ``bool``, ``str``, ``X | None``, ``tuple[X, ...]`` / ``list[X]`` / ``tuple[X, Y]`` (a
JSON array of such), ``Literal[...]`` (one of its values) and a nested dataclass (an object,
checked the same way). Any other annotation is left to the dataclass.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any, Literal

from deepserve.protocol import GenerateRequest

_INT64 = (-(1 << 63), (1 << 63) - 1)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fail(path: str, what: str, value: Any) -> ValueError:
    shown = repr(value)
    return ValueError(f"{path} must be {what}, not {shown[:40] + '...' if len(shown) > 40 else shown}")


def check_value(tp: Any, value: Any, path: str) -> None:
    """Raise ``ValueError`` unless ``value`` (decoded JSON) fits the annotation ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return check_value(rest[0], value, path)
        return  # a wider union: left to the dataclass
    if origin is Literal:
        if value not in typing.get_args(tp) or isinstance(value, bool):
            raise _fail(path, "one of " + ", ".join(map(repr, typing.get_args(tp))), value)
        return
    if origin in (tuple, list):
        args = typing.get_args(tp)
        if not isinstance(value, list):
            raise _fail(path, "an array", value)
        if origin is list or args[-1:] == (Ellipsis,):  # homogeneous: list[X], tuple[X, ...]
            for i, item in enumerate(value):
                check_value(args[0], item, f"{path}[{i}]")
        elif len(value) != len(args):  # a fixed shape: tuple[X, Y]
            raise _fail(path, f"an array of {len(args)}", value)
        else:
            for i, (a, item) in enumerate(zip(args, value)):
                check_value(a, item, f"{path}[{i}]")
        return
    if tp is bool:
        if not isinstance(value, bool):
            raise _fail(path, "a boolean", value)
    elif tp is int:
        if type(value) is not int:
            raise _fail(path, "an integer", value)
        if not _INT64[0] <= value <= _INT64[1]:
            raise _fail(path, "a 64-bit integer", value)
    elif tp is float:
        if type(value) not in (int, float) or not math.isfinite(value):
            raise _fail(path, "a number", value)
    elif tp is str:
        if not isinstance(value, str):
            raise _fail(path, "a string", value)
    elif dataclasses.is_dataclass(tp):
        check_fields(tp, value, path)


def check_fields(cls: type, d: Any, path: str) -> None:
    """``d`` is a JSON object whose fields of the dataclass ``cls`` have the annotated types
    (unknown fields are ignored, as ``from_dict`` ignores them)."""
    if not isinstance(d, dict):
        raise _fail(path, "an object", d)
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in d:
            check_value(hints[f.name], d[f.name], f"{path}.{f.name}" if path else f.name)


def check_generate(d: Any) -> dict[str, Any]:
    """``d``, less its null fields (null = the default), if it is a well-typed
    ``GenerateRequest`` body; else ``ValueError``. Required: ``request_id`` (a string or an
    integer) and ``prompt_token_ids``."""
    if not isinstance(d, dict):
        raise _fail("body", "an object", d)
    for name in ("request_id", "prompt_token_ids"):
        if d.get(name) is None:
            raise ValueError(f"missing {name!r}")
    rid = d["request_id"]
    if type(rid) not in (str, int) or isinstance(rid, bool):
        raise _fail("request_id", "a string", rid)
    body = {k: v for k, v in d.items() if v is not None}
    check_fields(GenerateRequest, {k: v for k, v in body.items() if k != "request_id"}, "")
    return body
