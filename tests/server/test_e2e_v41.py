"""End to end for DeepSeek-V4.1: `deepserve up --model <tiny-v41>` through the real SDKs.

The gateway renders V4.1 chat prompts (deepseek-recipe's V4.1 encoding: ``<｜System｜>`` is
id 128799 of the checkpoint's tokenizer), the engine runs our V4.1 model, and the greedy tokens
served equal our model's own greedy run on the rendered prompt ids (fp32, the same checkpoint).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch

from engine.model.v41.tokenizer import SYSTEM_TOKEN_ID
from tests.server.conftest import LiveStack, engine_missing_reason, run_up

pytestmark = [pytest.mark.skipif(engine_missing_reason() is not None, reason=engine_missing_reason() or ""), pytest.mark.timeout(300)]

MODEL = "DeepSeek-V4.1-Flash"
SYSTEM_USER = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]
NO_THINK = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-v41") / "model", seed=0, preset="tiny-v41")


@pytest.fixture(scope="module")
def v41_stack(v41_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    with run_up(["--model", str(v41_dir), "--max-model-len", "1024"], tmp_path_factory.mktemp("up-v41")) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(v41_stack: LiveStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=v41_stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """Our V4.1 model's greedy continuation of ``prompt``: one prefill, then one token at a time."""
    from engine.model.v41.loader import load_v41_model

    model = load_v41_model(model_dir, dtype="float32")
    state, out = model.new_state(), []
    logits = model([(state, prompt)])[0]
    for _ in range(n):
        out.append(int(torch.argmax(logits)))
        logits = model([(state, [out[-1]])])[0]
    return out


def render(stack: LiveStack, messages: list[dict], **extra) -> list[int]:
    r = httpx.post(stack.url + "/v1/chat/completions/render", json={"model": MODEL, "messages": messages, **extra}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["prompt_token_ids"]


def test_models_list_the_v41_name(client: openai.OpenAI) -> None:
    assert MODEL in {m.id for m in client.models.list().data}


def test_chat_renders_the_v41_encoding(v41_stack: LiveStack) -> None:
    ids = render(v41_stack, SYSTEM_USER, **NO_THINK)
    assert ids[:2] == [0, SYSTEM_TOKEN_ID]  # BOS, then V4.1's own system token (V4 has none)


def test_served_greedy_tokens_are_the_models(v41_stack: LiveStack, client: openai.OpenAI, v41_dir: Path) -> None:
    """The rendered chat prompt through /v1/completions (token ids in, text out) and the chat
    endpoint itself both give our model's greedy continuation."""
    ids = render(v41_stack, SYSTEM_USER, **NO_THINK)
    want = greedy(v41_dir, ids, 12)
    tok = v41_stack_tokenizer(v41_dir)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True, "skip_special_tokens": False})  # fmt: skip
    assert r.choices[0].text == tok.decode(want, skip_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12
    chat = client.chat.completions.create(model=MODEL, messages=SYSTEM_USER, max_tokens=12, temperature=0,
                                          extra_body={**NO_THINK, "ignore_eos": True})  # fmt: skip
    assert chat.usage.prompt_tokens == len(ids) and chat.usage.completion_tokens == 12


def v41_stack_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer through the ``tokenizers`` library (not the gateway's own code)."""
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_reasoning_is_split_out(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=SYSTEM_USER, max_tokens=16, seed=3,
                                       extra_body={"chat_template_kwargs": {"thinking": True}})  # fmt: skip
    assert isinstance(r.choices[0].message.model_extra.get("reasoning_content"), str)
    assert r.usage.completion_tokens <= 16


def test_structured_output_validates(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green"]},
                                                "count": {"type": "integer", "enum": [1, 2, 3]}},
              "required": ["colour", "count"], "additionalProperties": False}  # fmt: skip
    r = client.chat.completions.create(
        model=MODEL, messages=SYSTEM_USER, max_tokens=64, temperature=0, extra_body=NO_THINK,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_required_tool_call_parses(client: openai.OpenAI) -> None:
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["n"]}}}  # fmt: skip
    r = client.chat.completions.create(model=MODEL, messages=SYSTEM_USER, max_tokens=64, temperature=0,
                                       tools=[tool], tool_choice="required", extra_body=NO_THINK)  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "pick" and isinstance(json.loads(call.function.arguments)["n"], int)


def test_anthropic_messages_with_system(v41_stack: LiveStack) -> None:
    c = anthropic.Anthropic(base_url=v41_stack.url, api_key="unused", max_retries=0)
    m = c.messages.create(model=MODEL, system="Answer briefly.", max_tokens=8,
                          messages=[{"role": "user", "content": "Name a colour."}])  # fmt: skip
    assert m.usage.output_tokens <= 8 and m.stop_reason in ("end_turn", "max_tokens")


def test_prefix_hit_shows_in_usage(client: openai.OpenAI) -> None:
    """A repeated long prompt resumes from the KV store's V4.1 records: cached tokens in usage
    (whole 128-token units), the same greedy answer."""
    long = [{"role": "system", "content": "Facts: " + " ".join(f"item {i} is {i * 7 % 13}." for i in range(60))},
            {"role": "user", "content": "Which item is 5?"}]  # fmt: skip
    first = client.chat.completions.create(model=MODEL, messages=long, max_tokens=8, temperature=0, extra_body=NO_THINK)
    again = client.chat.completions.create(model=MODEL, messages=long, max_tokens=8, temperature=0, extra_body=NO_THINK)
    assert first.usage.prompt_tokens > 256
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 256 and cached % 128 == 0, cached
    assert again.choices[0].message.content == first.choices[0].message.content
