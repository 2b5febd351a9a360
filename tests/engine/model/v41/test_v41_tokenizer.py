"""The V4.1 tokenizer derived from V4's: ``<｜System｜>`` is one token, id 128799; nothing else moves."""

from __future__ import annotations

import json

import pytest
import tokenizers

from engine.model.tiny import default_tokenizer_path
from engine.model.v41.tokenizer import SYSTEM_TOKEN, SYSTEM_TOKEN_ID, v41_tokenizer_json, write_v41_tokenizer


def test_system_token_is_one_id_and_the_rest_is_v4(tmp_path) -> None:
    v4 = tokenizers.Tokenizer.from_file(str(default_tokenizer_path()))
    v41 = tokenizers.Tokenizer.from_file(str(write_v41_tokenizer(default_tokenizer_path(), tmp_path / "t.json")))
    text = "<｜begin▁of▁sentence｜>" + SYSTEM_TOKEN + "Be brief.<｜User｜>héllo, 世界<｜Assistant｜></think>"
    ids = v41.encode(text, add_special_tokens=False).ids
    assert ids[1] == SYSTEM_TOKEN_ID and v41.decode(ids, skip_special_tokens=False) == text
    rest = text.replace(SYSTEM_TOKEN, "")
    assert v41.encode(rest, add_special_tokens=False).ids == v4.encode(rest, add_special_tokens=False).ids
    assert v41.get_vocab_size() == v4.get_vocab_size()


def test_a_tokenizer_without_the_placeholder_is_refused() -> None:
    v4 = json.loads(default_tokenizer_path().read_text(encoding="utf-8"))
    v4["added_tokens"] = [t for t in v4["added_tokens"] if t["id"] != SYSTEM_TOKEN_ID]
    with pytest.raises(ValueError, match="not a DeepSeek V4 tokenizer"):
        v41_tokenizer_json(v4)
