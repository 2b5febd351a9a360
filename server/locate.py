"""Which request field a deepseek-recipe refusal is about, when the recipe does not say.

The recipe's body parser (serde) answers a mistyped field with text such as ``invalid type:
string "yes", expected a boolean`` and no field name, and some of its checks answer ``param:
null`` (``Invalid top_p value ...``); an integer beyond 64 bits raises ``OverflowError`` before
any check. The project's rule is that a refusal names the field, so on that error path (never on
a request that converts) ``locate`` finds it by converting the body again without one field at a
time: the field whose removal makes the request convert (or else the first whose removal changes
the refusal to another one that is not a mere "missing field") is the one refused. Inside a list field (``messages``,
``tools``, ``input``, ``system``) the same is done per item, and inside that item per key, so the
answer is as precise as ``messages[2].content``. At most ``MAX_TRIES`` conversions are tried.
"""

from __future__ import annotations

from typing import Any, Callable

MAX_TRIES = 96
_MISSING = ("missing field", "required", "at least one", "empty input", "must not be empty", "must have non-empty")

Attempt = Callable[[Any], "str | None"]  # a body -> None when it converts, else the refusal's text


def _evidence(original: str, now: str | None) -> bool:
    if now is None:
        return True
    return now != original and not any(m in now.lower() for m in _MISSING)


class _Budget:
    def __init__(self, attempt: Attempt) -> None:
        self.attempt, self.left = attempt, MAX_TRIES

    def __call__(self, body: Any) -> str | None | bool:
        if self.left <= 0:
            return False  # out of tries: no evidence
        self.left -= 1
        return self.attempt(body)


# Required fields are replaced by a plain value of their kind instead of removed (a removal would
# only say "missing field").
NEUTRAL: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}], "input": "x"}


def _culprit_key(
    rebuild: Callable[[dict[str, Any]], Any], obj: dict[str, Any], original: str, tries: _Budget,
    skip: tuple[str, ...] = (), neutral: dict[str, Any] | None = None,
) -> str | None:
    neutral = neutral or {}
    changed: str | None = None  # the first key whose removal changes the refusal
    # A message's role last: another role can make any message convert, so it only answers when
    # no other key explains the refusal.
    for key in sorted(obj, key=lambda k: k == "role"):
        if key in skip:
            continue
        if key == "role" and changed is not None:
            return changed
        if key in neutral:
            if obj[key] == neutral[key]:
                continue
            candidate = {**obj, key: neutral[key]}
        else:
            candidate = {k: v for k, v in obj.items() if k != key}
        now = tries(rebuild(candidate))
        if now is None:
            return key  # without it the request converts: the surest answer
        if changed is None and now is not False and _evidence(original, now):  # type: ignore[arg-type]
            changed = key
    return changed


def _culprit_index(rebuild: Callable[[list[Any]], Any], items: list[Any], original: str, tries: _Budget) -> int | None:
    if len(items) == 1:
        return 0
    for i in range(len(items)):
        now = tries(rebuild(items[:i] + items[i + 1:]))
        if now is not False and _evidence(original, now):  # type: ignore[arg-type]
            return i
    return None


INNER_NEUTRAL: dict[str, Any] = {"role": "user", "content": "x"}
MAX_DEPTH = 5


def _descend(value: Any, rebuild: Callable[[Any], Any], path: str, original: str, tries: _Budget, depth: int) -> str:
    if depth >= MAX_DEPTH:
        return path
    if isinstance(value, dict) and value:
        top = depth == 0
        key = _culprit_key(
            rebuild, value, original, tries, skip=("model",) if top else ("type",), neutral=NEUTRAL if top else INNER_NEUTRAL
        )
        if key is None:
            return path
        return _descend(
            value[key], lambda v: rebuild({**value, key: v}), f"{path}.{key}" if path else key, original, tries, depth + 1
        )
    if isinstance(value, list) and value and path:
        index = _culprit_index(rebuild, value, original, tries)
        if index is None:
            return path
        return _descend(
            value[index], lambda v: rebuild(value[:index] + [v] + value[index + 1:]), f"{path}[{index}]", original, tries, depth + 1
        )
    return path


def locate(body: dict[str, Any], original: str, attempt: Attempt) -> str | None:
    """The path of the field ``attempt(body)`` refuses with ``original`` (None: not found)."""
    return _descend(body, lambda b: b, "", original, _Budget(attempt), 0) or None


def huge_int_path(value: Any, path: str = "") -> str | None:
    """The path of the first integer outside the signed/unsigned 64-bit range in ``value``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return path if not -(1 << 63) <= value < (1 << 64) else None
    if isinstance(value, dict):
        for k, v in value.items():
            found = huge_int_path(v, f"{path}.{k}" if path else str(k))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = huge_int_path(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None
