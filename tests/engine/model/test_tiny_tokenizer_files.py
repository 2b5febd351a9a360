"""The tiny checkpoint carries a released checkpoint's tokenizer files: a Hugging Face tokenizer
read from it (as evaluation harnesses and benchmark clients load one) knows BOS and EOS."""

from __future__ import annotations

import json

from transformers import AutoTokenizer


def test_hf_tokenizer_of_the_tiny_checkpoint_knows_bos_and_eos(tiny_model_dir) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert (tok.bos_token_id, tok.eos_token_id) == (ids["bos_token_id"], ids["eos_token_id"]) == (0, 1)
    assert tok.encode("hi", add_special_tokens=False) and None not in tok.encode("hi")
