"""The DeepSeek-V4.1 ``tokenizer.json`` made from the V4 one (for checkpoints made here).

V4.1's tokenizer is V4's with one reserved placeholder named: id 128799 becomes ``<｜System｜>``,
the token V4.1's chat encoding opens a system message with (DSpark also reuses it as its draft
noise token). Everything else (BPE vocabulary, the other special tokens and their ids) is V4's,
so a gateway serving a tiny V4.1 checkpoint renders real V4.1 chat prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

SYSTEM_TOKEN = "<｜System｜>"
SYSTEM_TOKEN_ID = 128799
_PLACEHOLDER = "<｜place▁holder▁no▁799｜>"
_LIKE = "<｜User｜>"  # the new token takes the flags of V4's other role tokens


def v41_tokenizer_json(v4: dict) -> dict:
    """``v4`` (a parsed V4 ``tokenizer.json``) with ``<｜System｜>`` at id 128799."""
    added = v4.get("added_tokens") or []
    by_id = {int(t["id"]): t for t in added}
    slot = by_id.get(SYSTEM_TOKEN_ID)
    if slot is None or slot.get("content") not in (_PLACEHOLDER, SYSTEM_TOKEN):
        raise ValueError(f"not a DeepSeek V4 tokenizer: id {SYSTEM_TOKEN_ID} is {slot and slot.get('content')!r}, not {_PLACEHOLDER!r}")
    like = next((t for t in added if t.get("content") == _LIKE), None)
    if like is None:
        raise ValueError(f"not a DeepSeek V4 tokenizer: no {_LIKE!r}")
    named = {**like, "id": SYSTEM_TOKEN_ID, "content": SYSTEM_TOKEN}
    return {**v4, "added_tokens": [named if int(t["id"]) == SYSTEM_TOKEN_ID else t for t in added]}


def write_v41_tokenizer(v4_path: Path, out: Path) -> Path:
    """Write the V4.1 ``tokenizer.json`` derived from the V4 one at ``v4_path`` to ``out``."""
    out.write_text(json.dumps(v41_tokenizer_json(json.loads(v4_path.read_text(encoding="utf-8"))), ensure_ascii=False), encoding="utf-8")
    return out
