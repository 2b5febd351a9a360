"""JSON schemas as xgrammar can enforce them: OpenAI strict-mode translation and a keyword audit.

Part of the protocol: it defines which ``OutputConstraint(kind="json")`` specs are valid. Pure
Python (no torch, no xgrammar, no other package of the project), so the gateway refuses a schema with a 400 naming the keyword
before any engine sees it, and the engine's compiler runs the same audit on what reaches it.

The rule: every output the grammar allows validates against the client's schema. So the grammar is
built from the client's own schema (never from a normalised copy that dropped keywords), and a
keyword xgrammar ignores or only approximates is refused, not dropped. What xgrammar enforces
exactly (checked keyword by keyword, and by the property test over random schemas): ``type``,
``enum``, ``const``, ``anyOf``, ``$ref`` / ``$defs`` / ``definitions`` (local references),
``allOf`` with one branch, ``oneOf`` whose branches no value matches twice (disjoint JSON types,
or objects tagged by a required property's string constants: pydantic's discriminated unions),
``properties``,
``required`` (declared properties only), ``additionalProperties``, ``minProperties`` /
``maxProperties``, ``items``, ``prefixItems``, ``minItems`` / ``maxItems``, ``minLength`` /
``maxLength`` (without ``pattern``), ``pattern``, ``format`` (``email`` / ``ipv6`` / ``uuid`` by
xgrammar; ``date``, ``time``, ``date-time``, ``duration``, ``ipv4``, ``hostname`` as stricter
patterns of ours, since xgrammar's accept invalid values or has none), ``minimum`` /
``maximum`` / ``exclusiveMinimum`` / ``exclusiveMaximum``, and an integer ``multipleOf`` (of an
``integer`` or ``number``, emitted as integers): xgrammar's own up to 1024 without bounds, and
between two bounds as the ``enum`` of the multiples (at most ``MAX_MULTIPLES``).
Refused (xgrammar accepts values the schema rejects): ``uniqueItems``, ``contains``, ``not``,
``if`` / ``then`` / ``else``, ``dependentRequired`` / ``dependentSchemas``, overlapping ``oneOf``,
multi-branch ``allOf``, any other ``multipleOf`` (xgrammar ignores it beside a bound, or a
fraction, or above 1024), ``minLength`` /
``maxLength`` beside ``pattern``, a ``pattern`` with a quantified group, unknown formats, and every
keyword not listed here. Annotations (``title``, ``description``,
``default``, ...) are ignored, as JSON Schema defines them.

xgrammar narrows where it cannot widen: with no ``additionalProperties`` it allows none, and a
``pattern`` must match the whole string; both only ever drop outputs the schema would accept.

``enum`` / ``const`` values that the node's ``type`` rejects are dropped from the grammar (the
schema accepts none of them); other validation keywords beside an ``enum`` or ``const`` are refused
(xgrammar would emit an enum value without checking them).

``minProperties`` above the number of ``required`` properties is refused where additional
properties are allowed: xgrammar keeps an extra key distinct from the declared ones but not from
another extra key, and a repeated key counts once in the parsed object.

Strict mode (``strict: true``) means what OpenAI's structured outputs mean: every object's
properties are all required and no additional properties are allowed; ``strict_schema`` adds
both where the client left them out and refuses a schema that says otherwise, except that an
``additionalProperties`` given as a schema is kept (vLLM and SGLang honour it; the answer still
validates against the client's schema).
"""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any


Path = tuple[str | int, ...]

ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$comment", "$schema", "$id", "deprecated",
        "readOnly", "writeOnly", "nullable", "discriminator", "contentEncoding", "contentMediaType",
    }
)
TYPE_KEYWORDS: dict[str, frozenset[str]] = {
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
    "array": frozenset({"items", "prefixItems", "minItems", "maxItems"}),
    "object": frozenset({"properties", "required", "additionalProperties", "minProperties", "maxProperties"}),
}
GENERAL_KEYWORDS = frozenset({"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions"})
SUPPORTED = GENERAL_KEYWORDS.union(*TYPE_KEYWORDS.values())
FORMATS = frozenset({"email", "ipv6", "uuid"})  # xgrammar's own grammars for these hold
# Formats xgrammar gets wrong (its ``date`` allows 2021-02-30 and year 0, its ``ipv4`` leading
# zeros) or that nothing here checks, replaced by a pattern whose every match is valid: a subset
# (no leap days, leap seconds or fractions of a second, hostnames of <= 3 short labels, durations
# of <= 4-digit numbers).
_DATE = (
    "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})-"
    "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_LABEL = "[a-z0-9]{1,16}"  # a short label (63 characters and hyphens allowed; counted repeats compile slowly)
_N = "[0-9]{1,4}"
_DUR_DATE = f"(?:{_N}Y|{_N}Y{_N}M|{_N}Y{_N}M{_N}D|{_N}M|{_N}M{_N}D|{_N}D)"
_DUR_TIME = f"T(?:{_N}H|{_N}H{_N}M|{_N}H{_N}M{_N}S|{_N}M|{_N}M{_N}S|{_N}S)"  # RFC 3339 Appendix A: no H without M before S
FORMAT_PATTERNS: dict[str, str] = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "ipv4": f"^{_OCTET}\\.{_OCTET}\\.{_OCTET}\\.{_OCTET}$",
    "hostname": f"^(?:{_LABEL}|{_LABEL}\\.{_LABEL}|{_LABEL}\\.{_LABEL}\\.{_LABEL})$",
    "duration": f"^P(?:{_DUR_DATE}|{_DUR_DATE}{_DUR_TIME}|{_DUR_TIME}|{_N}W)$",
}
# xgrammar compiles a schema ``pattern`` wrongly when a group carries a quantifier: ``(?:a*[0-9])?``
# also matches "a" (found by fuzzing its schema path against Python's ``re``; its plain regex path
# is right). Such patterns are refused, as are regex features outside ECMA-262's common core.
_QUANTIFIED_GROUP = re.compile(r"\)[*+?{]")
_UNSUPPORTED_REGEX = re.compile(r"\(\?[=!<]|\\[1-9]|[*+?}][+]")
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
MAX_MULTIPLES = 1000  # a bounded ``multipleOf`` becomes an enum of at most this many integers
XGRAMMAR_MAX_MULTIPLE = 1024  # xgrammar ignores a larger integer ``multipleOf``
JSON_TYPES = frozenset({"null", "boolean", "integer", "number", "string", "array", "object"})


class SchemaError(ValueError):
    """A schema the grammar cannot enforce exactly. ``path`` locates the offending keyword inside
    the schema (``("properties", "count", "uniqueItems")``)."""

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(message)
        self.path = path

    @property
    def location(self) -> str:
        """The path as dotted text, list indexes in brackets: ``properties.a.anyOf[1].minLength``."""
        out = ""
        for p in self.path:
            out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
        return out


def enforceable_schema(schema: Any, *, strict: bool) -> str:
    """The compact JSON to compile for a client's schema: OpenAI's strict translation when
    ``strict``, enum values the type rejects dropped, every keyword audited (``SchemaError``)."""
    if not isinstance(schema, (dict, bool)):
        raise SchemaError("The schema must be a JSON object.", ())
    out = strict_schema(schema) if strict else copy.deepcopy(schema)
    _Audit(out).node(out, ())
    return json.dumps(out, separators=(",", ":"), ensure_ascii=False)


def strict_schema(schema: Any, path: Path = ()) -> Any:
    """A copy with OpenAI strict mode spelled out: each object requires all its properties and
    allows no others unless its ``additionalProperties`` is a schema (kept: the extras it allows
    are the client's own). Refuses a ``required`` that leaves one out, or ``additionalProperties:
    true``."""
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict_children(k, v, path + (k,)) for k, v in schema.items()}
    if _is_object(out):
        props = out.get("properties", {})
        names = list(props) if isinstance(props, dict) else []
        req = out.get("required")
        if req is not None and (not isinstance(req, list) or set(req) != set(names)):
            raise SchemaError("In strict mode 'required' must list every key in 'properties'.", path + ("required",))
        out["required"] = names
        extra = out.get("additionalProperties", False)
        if extra is not False and not isinstance(extra, dict):
            raise SchemaError(
                "In strict mode 'additionalProperties' must be false or a schema.", path + ("additionalProperties",)
            )
        out["additionalProperties"] = extra
    return out


def _strict_children(key: str, value: Any, path: Path) -> Any:
    if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
        return {name: strict_schema(sub, path + (name,)) for name, sub in value.items()}
    if key in ("anyOf", "oneOf", "allOf", "prefixItems") and isinstance(value, list):
        return [strict_schema(sub, path + (i,)) for i, sub in enumerate(value)]
    if key in ("items", "additionalProperties") and isinstance(value, dict):
        return strict_schema(value, path)  # path already ends with the key
    return value


def _is_object(node: dict[str, Any]) -> bool:
    t = node.get("type")
    return t == "object" or (isinstance(t, list) and "object" in t) or (t is None and "properties" in node)


def _types(node: Any) -> frozenset[str] | None:
    """The JSON types a schema node can accept, when evident from ``type``/``const``/``enum``."""
    if not isinstance(node, dict):
        return None
    t = node.get("type")
    if isinstance(t, str):
        return frozenset({"integer", "number"} if t == "number" else {t})
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return frozenset().union(*({"integer", "number"} if x == "number" else {x} for x in t))
    values = [node["const"]] if "const" in node else node.get("enum")
    if isinstance(values, list):
        return frozenset(_type_of(v) for v in values)
    return None


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _type_accepts(types: Any, value: Any) -> bool:
    names = [types] if isinstance(types, str) else types
    actual = _type_of(value)
    return any(n == actual or (n == "number" and actual == "integer") for n in names)


class _Audit:
    """Walks a schema in place, refusing what xgrammar cannot enforce and filtering enums."""

    def __init__(self, root: Any) -> None:
        self.root = root

    def node(self, node: Any, path: Path, *, may_be_false: bool = False) -> None:
        if node is True or (node is False and may_be_false):
            return
        if not isinstance(node, dict):
            raise SchemaError("A schema must be a JSON object (or true).", path)
        for key in node:
            if key not in SUPPORTED and key not in ANNOTATIONS and not key.startswith("x-"):
                raise SchemaError(f"The schema keyword '{key}' is not supported for constrained output.", path + (key,))
        self._type(node, path)
        self._values(node, path)
        self._combinators(node, path)
        self._string(node, path)
        self._numbers(node, path)
        self._children(node, path)

    def _type(self, node: dict[str, Any], path: Path) -> None:
        t = node.get("type")
        if t is None:
            for kind, words in TYPE_KEYWORDS.items():
                word = next((w for w in words if w in node), None)
                if word is not None and not (kind == "object" and word == "properties"):
                    raise SchemaError(f"'{word}' needs a 'type' beside it.", path + (word,))
            return
        names = [t] if isinstance(t, str) else t
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n in JSON_TYPES for n in names):
            raise SchemaError("'type' must be a JSON type name or a list of them.", path + ("type",))

    def _values(self, node: dict[str, Any], path: Path) -> None:
        if "enum" not in node and "const" not in node:
            return
        word = "const" if "const" in node else "enum"
        others = [k for k in node if k in SUPPORTED and k not in ("type", "enum", "const", "$defs", "definitions")]
        if others:
            raise SchemaError(f"'{others[0]}' beside '{word}' is not supported for constrained output.", path + (others[0],))
        if "enum" in node and "const" in node:
            raise SchemaError("Use either 'enum' or 'const', not both.", path + ("const",))
        t = node.get("type")
        if word == "const":
            if t is not None and not _type_accepts(t, node["const"]):
                raise SchemaError("'const' does not match the schema's 'type'.", path + ("const",))
            return
        values = node["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaError("'enum' must be a non-empty array.", path + ("enum",))
        if t is not None:
            node["enum"] = [v for v in values if _type_accepts(t, v)]
            if not node["enum"]:
                raise SchemaError("No 'enum' value matches the schema's 'type'.", path + ("enum",))

    def _combinators(self, node: dict[str, Any], path: Path) -> None:
        for word in ("anyOf", "oneOf", "allOf"):
            branches = node.get(word)
            if word in node and (not isinstance(branches, list) or not branches):
                raise SchemaError(f"'{word}' must be a non-empty array of schemas.", path + (word,))
        if len(node.get("allOf", ())) > 1:
            raise SchemaError("'allOf' with more than one schema is not supported for constrained output.", path + ("allOf",))
        branches = node.get("oneOf") or []
        for i, a in enumerate(branches):
            if any(not self._disjoint(a, b) for b in branches[i + 1 :]):
                raise SchemaError(
                    "'oneOf' is supported only when no value can match two of its schemas (different JSON types, or "
                    "objects told apart by a required property's string constants); use 'anyOf'.",
                    path + ("oneOf",),
                )
        ref = node.get("$ref")
        if ref is not None:
            self._resolve(ref, path + ("$ref",))

    def _resolve(self, ref: Any, path: Path) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError("Only local '$ref's ('#/...') are supported.", path)
        target = self.root
        for part in ref[1:].split("/")[1:] if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise SchemaError(f"'$ref' {ref!r} does not resolve inside the schema.", path)
            target = target[part]
        return target

    def _target(self, node: Any) -> Any:
        """The schema a bare ``$ref`` (annotations aside) stands for, following a few in a row; a
        reference that does not resolve stays (the walk refuses it where it is)."""
        for _ in range(8):
            if not isinstance(node, dict) or "$ref" not in node or any(k != "$ref" and k not in ANNOTATIONS for k in node):
                return node
            try:
                node = self._resolve(node["$ref"], ())
            except SchemaError:
                return node
        return node

    def _disjoint(self, a: Any, b: Any) -> bool:
        """Whether no value matches both schemas: their JSON types differ, or both accept only
        objects that require a property whose string constants differ (a tagged union, as
        pydantic writes a discriminated one); ``oneOf`` is then ``anyOf``, which xgrammar enforces."""
        a, b = self._target(a), self._target(b)
        ta, tb = _types(a), _types(b)
        if ta is not None and tb is not None and not ta & tb:
            return True
        if ta != {"object"} or tb != {"object"}:
            return False
        shared = set(_names(a.get("required"))) & set(_names(b.get("required")))
        for name in shared:
            va, vb = self._tags(a, name), self._tags(b, name)
            if va is not None and vb is not None and not va & vb:
                return True
        return False

    def _tags(self, node: dict[str, Any], name: str) -> frozenset[str] | None:
        """The strings a property's ``const`` / ``enum`` allows, or None when not only strings."""
        props = node.get("properties")
        sub = self._target(props.get(name)) if isinstance(props, dict) else None
        if not isinstance(sub, dict):
            return None
        values = [sub["const"]] if "const" in sub else sub.get("enum")
        if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
            return None
        return frozenset(values)

    def _string(self, node: dict[str, Any], path: Path) -> None:
        fmt = node.get("format")
        if fmt in FORMAT_PATTERNS:
            if "pattern" in node:
                raise SchemaError(f"'format' {fmt!r} beside 'pattern' is not supported for constrained output.", path + ("format",))
            node["pattern"] = FORMAT_PATTERNS[node.pop("format")]
        elif fmt is not None and fmt not in FORMATS:
            raise SchemaError(f"The string format {fmt!r} is not supported for constrained output.", path + ("format",))
        if "pattern" in node:
            if not isinstance(node["pattern"], str):
                raise SchemaError("'pattern' must be a string.", path + ("pattern",))
            bare = _without_classes(node["pattern"])
            if _QUANTIFIED_GROUP.search(bare):
                raise SchemaError(
                    "A 'pattern' with a quantified group ('(...)?', '(...)*', ...) is not supported for constrained output.",
                    path + ("pattern",),
                )
            if _UNSUPPORTED_REGEX.search(bare):
                raise SchemaError("Lookarounds, backreferences and possessive quantifiers are not supported in 'pattern'.", path + ("pattern",))
            for word in ("minLength", "maxLength"):
                if word in node:
                    raise SchemaError(f"'{word}' beside 'pattern' is not supported; put the length in the pattern.", path + (word,))
        for word in ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"):
            if word in node and not _count(node[word]):
                raise SchemaError(f"'{word}' must be a non-negative integer.", path + (word,))

    def _numbers(self, node: dict[str, Any], path: Path) -> None:
        for word in BOUNDS:
            v = node.get(word)
            if word in node and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                raise SchemaError(f"'{word}' must be a number.", path + (word,))
        if "multipleOf" in node:
            _multiple_of(node, path + ("multipleOf",))

    def _children(self, node: dict[str, Any], path: Path) -> None:
        props = node.get("properties", {})
        if not isinstance(props, dict):
            raise SchemaError("'properties' must be an object.", path + ("properties",))
        for name, sub in props.items():
            self.node(sub, path + ("properties", name))
        req = node.get("required", [])
        if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
            raise SchemaError("'required' must be an array of property names.", path + ("required",))
        missing = [r for r in req if r not in props]
        if missing:
            raise SchemaError(f"Required property {missing[0]!r} is not declared in 'properties'.", path + ("required",))
        if node.get("minProperties", 0) > len(set(req)) and node.get("additionalProperties", False) is not False:
            raise SchemaError(
                "'minProperties' above the required properties is not supported when additional properties are allowed.",
                path + ("minProperties",),
            )
        for word in ("$defs", "definitions"):
            defs = node.get(word, {})
            if not isinstance(defs, dict):
                raise SchemaError(f"'{word}' must be an object.", path + (word,))
            for name, sub in defs.items():
                self.node(sub, path + (word, name))
        if "prefixItems" in node and not isinstance(node["prefixItems"], list):
            raise SchemaError("'prefixItems' must be an array of schemas.", path + ("prefixItems",))
        for word in ("anyOf", "oneOf", "allOf", "prefixItems"):
            for i, sub in enumerate(node.get(word, ())):
                self.node(sub, path + (word, i))
        for word in ("items", "additionalProperties"):
            if word in node:
                self.node(node[word], path + (word,), may_be_false=True)


def _multiple_of(node: dict[str, Any], path: Path) -> None:
    """Rewrite a node's integer ``multipleOf`` into what xgrammar enforces exactly, in place:
    ``type: integer`` (every output an integer, which a ``number`` also accepts) with the
    ``multipleOf`` alone, or, between two bounds, the ``enum`` of the multiples."""
    m = node["multipleOf"]
    if isinstance(m, bool) or not isinstance(m, int) or m <= 0:
        raise SchemaError("'multipleOf' is supported only as a positive integer for constrained output.", path)
    if node.get("type") not in ("integer", "number"):
        raise SchemaError("'multipleOf' is supported only beside 'type' 'integer' or 'number'.", path)
    node["type"] = "integer"
    if not any(w in node for w in BOUNDS):
        if m > XGRAMMAR_MAX_MULTIPLE:
            raise SchemaError(f"'multipleOf' above {XGRAMMAR_MAX_MULTIPLE} needs a 'minimum' and a 'maximum'.", path)
        return
    lows = [math.ceil(node["minimum"])] if "minimum" in node else []
    lows += [math.floor(node["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in node else []
    highs = [math.floor(node["maximum"])] if "maximum" in node else []
    highs += [math.ceil(node["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in node else []
    if not lows or not highs:
        raise SchemaError("'multipleOf' beside one bound is not supported; give both a minimum and a maximum.", path)
    first = -(-max(lows) // m) * m  # the least multiple >= the lower bound
    values = range(first, min(highs) + 1, m)
    if not values or len(values) > MAX_MULTIPLES:
        raise SchemaError(f"'multipleOf' between these bounds allows {len(values)} values (1 to {MAX_MULTIPLES} supported).", path)
    for word in (*BOUNDS, "multipleOf"):
        node.pop(word, None)
    node["enum"] = list(values)


def _without_classes(pattern: str) -> str:
    """The pattern with escapes and character classes blanked (``\\)`` or ``[)?]`` is no group)."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append("\\" + pattern[i + 1 : i + 2] if not in_class and pattern[i + 1 : i + 2].isdigit() else "__")
            i += 2
            continue
        if in_class:
            in_class = c != "]"
            out.append("_")
        elif c == "[":
            in_class = True
            out.append("_")
            if pattern[i + 1 : i + 2] == "]":  # a leading ']' is a literal
                out.append("_")
                i += 1
        else:
            out.append(c)
        i += 1
    return "".join(out)


def _names(required: Any) -> list[str]:
    return [r for r in required if isinstance(r, str)] if isinstance(required, list) else []


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
