"""Structured output with the real DeepSeek V4 tokenizer (vocab 129280) and random logits.

Random N(0, 1) logits at temperature 1 stand in for a model. Under a grammar they would wander
(whitespace runs, long strings) for hundreds of tokens, so ``bias`` nudges them the way a trained
model leans: toward EOS and closing punctuation, away from whitespace-only tokens. The grammar
still decides every token; the bias only shortens the walks.
"""

from __future__ import annotations

import functools
import json
import re

import deepseek_recipe as dr
import jsonschema
import pytest
import torch
from sampling_helpers import EOS, THINK_END, TOKENIZER_JSON, V4_VOCAB, run_to_end

from deepserve.protocol import OutputConstraint, SamplingParams
from engine.sampling import GrammarCompilerCache, InvalidConstraintError, Sampler, SamplerConfig
from engine.sampling.structured import allocate_bitmask, apply_bitmask

PET_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"type": "string", "enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                "vip": {"type": "boolean"},
            },
            "required": ["id", "vip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "age", "owner"],
    "additionalProperties": False,
}

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    },
]


def boost(tokenizer, b: torch.Tensor, texts: list[str], by: float) -> torch.Tensor:
    for text in texts:
        ids = tokenizer.encode(text).ids
        assert len(ids) == 1, text
        b[ids[0]] += by
    return b


@pytest.fixture(scope="module")
def bias(tokenizer) -> torch.Tensor:
    b = torch.zeros(V4_VOCAB)
    whitespace = [i for i in range(128000) if tokenizer.decode([i]).strip() == ""]
    b[whitespace] = -10.0
    b[EOS] = 5.0
    return boost(tokenizer, b, ['"', '",', '"}', '"]', "}", "]", ',"'], 9.0)


@pytest.fixture(scope="module")
def tool_bias(tokenizer, bias) -> torch.Tensor:
    """Also lean toward the DSML closing tags, so raw-text arguments end."""
    return boost(tokenizer, bias.clone(), ["</", "｜DSML｜", "parameter", ">\n"], 9.0)


def text_of(tokenizer, tokens: list[int]) -> str:
    assert tokens and tokens[-1] == EOS, "the grammar must end the output with EOS"
    return tokenizer.decode(tokens[:-1])


def generate(sampler, constraint, n, bias, *, seed, max_steps=200, prefix=(), **kw):
    """n constrained generations (after the forced output ``prefix``, if any); their new tokens."""
    p = [SamplingParams(max_tokens=max_steps, seed=seed * 1000 + i, constraint=constraint, **kw) for i in range(n)]
    states = [sampler.new_state(x, [0], output_token_ids=prefix) for x in p]
    tokens = run_to_end(sampler, states, seed=seed, max_steps=max_steps, bias=bias)
    assert all(s.finish_reason == "stop" for s in states), [s.finish_reason for s in states]
    return tokens


# -- the acceptance tests: every generation conforms ---------------------------------------------


def test_json_schema_generations_validate(v4_sampler, tokenizer, bias):
    c = OutputConstraint("json", json.dumps(PET_SCHEMA, separators=(",", ":")))
    for tokens in generate(v4_sampler, c, 50, bias, seed=1):
        value = json.loads(text_of(tokenizer, tokens))
        jsonschema.validate(value, PET_SCHEMA)


def test_json_mode_generations_are_objects(v4_sampler, tokenizer, bias):
    """No schema (response_format json_object): a JSON object, as OpenAI's JSON mode answers
    (langchain's json_mode parser and others read a dict)."""
    for tokens in generate(v4_sampler, OutputConstraint("json", ""), 10, bias, seed=2):
        assert isinstance(json.loads(text_of(tokenizer, tokens)), dict)


def test_regex_generations_match(v4_sampler, tokenizer, bias):
    pattern = r"[A-Z][a-z]{2,8} \d{1,3}(\.\d{1,2})? (USD|EUR)"
    for tokens in generate(v4_sampler, OutputConstraint("regex", pattern), 20, bias, seed=3):
        assert re.fullmatch(pattern, text_of(tokenizer, tokens))


EBNF = r"""
root ::= "[" item ("," item){0,4} "]"
item ::= number | word
number ::= "-"? [1-9] [0-9]{0,3}
word ::= "\"" [a-z]{1,6} "\""
"""


def test_ebnf_generations_match(v4_sampler, tokenizer, bias):
    for tokens in generate(v4_sampler, OutputConstraint("ebnf", EBNF), 20, bias, seed=4):
        value = json.loads(text_of(tokenizer, tokens))
        assert 1 <= len(value) <= 5
        for item in value:
            assert (isinstance(item, int) and 0 < abs(item) < 10000) or re.fullmatch(r"[a-z]{1,6}", item)


# -- tool calls, checked against deepseek-recipe's own renderer and parser ------------------------


def convert(tool_choice, tools=WEATHER_TOOLS, thinking=False):
    body = {
        "model": "DeepSeek-V4-Pro",
        "messages": [{"role": "user", "content": "weather in Paris?"}],
        "tools": tools,
        "tool_choice": tool_choice,
        "thinking": {"type": "enabled" if thinking else "disabled"},
    }
    return dr.ChatCompletionRequest(body).convert(dr.ConversionOptions())


@functools.cache
def recipe_tokenizer() -> dr.Tokenizer:
    return dr.Tokenizer.from_file(str(TOKENIZER_JSON))


def parse(request, tokens: list[int]) -> dict:
    """What the gateway would answer for these output tokens (EOS is not fed to the parser)."""
    gen = dr.ChatCompletionRequest.chunk_generator(request, "id", "m")
    proc = dr.StreamProcessor(gen, request.parsing_options, recipe_tokenizer())
    chunks = proc.push(dr.InferenceChunk.ready())
    chunks += proc.push(dr.InferenceChunk.tokens([t for t in tokens if t != EOS]))
    chunks += proc.push(dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop))
    chunks += proc.finish()
    resp = dr.ChatCompletionResponse("id", "m", 0, 0, 0)
    for ch in chunks:
        resp.accumulate(ch)
    return json.loads(resp.to_json())["choices"][0]


def constraint_of(request) -> OutputConstraint:
    oc = request.inference_options.output_constraint
    return OutputConstraint(oc.kind, oc.schema)


def assert_valid_calls(choice, tools=WEATHER_TOOLS):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and calls
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


def test_tool_call_required_generations_parse_into_valid_calls(v4_sampler, tool_bias):
    req = convert("required")
    c = constraint_of(req)
    assert c.kind == "tool_call_required" and req.parsing_options.starts_in_tool_calls
    for tokens in generate(v4_sampler, c, 6, tool_bias, seed=5):
        assert_valid_calls(parse(convert("required"), tokens))


def test_tool_call_required_unbiased_random_logits_parse(v4_sampler, tokenizer):
    """A random model with no help: whitespace runs are capped, and the DSML marker can only be
    the DSML token (plain-text spellings of its bar are masked), so every call parses."""
    req = convert("required")
    dsml = tokenizer.token_to_id("｜DSML｜")
    for tokens in generate(v4_sampler, constraint_of(req), 12, torch.zeros(V4_VOCAB), seed=11, max_steps=400):
        text_tokens = [tokenizer.id_to_token(t) or "" for t in tokens if t not in (dsml, EOS)]
        assert not any("｜" in tokenizer.decode([tokenizer.token_to_id(t)]) for t in text_tokens if tokenizer.token_to_id(t) is not None)
        assert_valid_calls(parse(convert("required"), tokens))


def test_tool_call_auto_generations_parse(v4_sampler, tokenizer, bias, tool_bias):
    req = convert("auto")
    c = constraint_of(req)
    assert c.kind == "tool_call"
    # A model that decided to call: its content and the block opening are given, the rest is random.
    prefix = tokenizer.encode("Let me check.\n\n<｜DSML｜tool_calls>\n").ids
    for tokens in generate(v4_sampler, c, 6, tool_bias, seed=6, prefix=prefix):
        choice = parse(convert("auto"), prefix + tokens)
        assert choice["message"]["content"] == "Let me check."
        assert_valid_calls(choice)
    # A model answering in text.
    chatty = bias.clone()
    chatty[EOS] += 7.0
    for tokens in generate(v4_sampler, c, 6, chatty, seed=7):
        choice = parse(convert("auto"), tokens)
        assert choice["finish_reason"] == "stop" and not choice["message"].get("tool_calls")
        assert choice["message"]["content"] == text_of(tokenizer, tokens)


def test_thinking_mode_tool_calls_start_after_think_end(v4_sampler, tokenizer, tool_bias):
    req = convert("auto", thinking=True)
    oc = req.inference_options.output_constraint
    c = OutputConstraint(oc.kind, oc.schema, trigger_token_ids=(THINK_END,))  # as the gateway sets it
    # Reasoning is unconstrained; after </think> the tool-call grammar holds.
    prefix = tokenizer.encode("I should call the weather tool.").ids + [THINK_END]
    prefix += tokenizer.encode("\n\n<｜DSML｜tool_calls>\n").ids
    for tokens in generate(v4_sampler, c, 4, tool_bias, seed=8, prefix=prefix):
        choice = parse(convert("auto", thinking=True), prefix + tokens)
        assert choice["message"]["reasoning_content"] == "I should call the weather tool."
        assert_valid_calls(choice)


def rendered_assistant(tool_calls_json: list[tuple[str, str]], content: str) -> str:
    """deepseek-recipe's rendering of an assistant turn with tool calls, after '<｜Assistant｜></think>'."""
    tools = [dr.ToolDefinition(t["function"]["name"], None, t["function"]["parameters"]) for t in WEATHER_TOOLS]
    calls = [dr.ToolCall(f"c{i}", n, a) for i, (n, a) in enumerate(tool_calls_json)]
    conv = dr.Conversation(
        [dr.UserMessage("hi"), dr.AssistantMessage(content, tool_calls=calls)], tools=tools, thinking_mode=False
    )
    prompt = dr.DeepseekV4Encoding().render_conversation(conv).prompt
    return prompt.split("<｜Assistant｜></think>", 1)[1].split("<｜end▁of▁sentence｜>", 1)[0]


CALLS = [("get_weather", '{"city": "Paris", "days": 3, "unit": "c"}'), ("add", '{"a": 1, "b": 2.5}')]


def accepts(grammars, constraint, text, tokenizer) -> bool:
    g = grammars.new_state(constraint)
    ids = tokenizer.encode(text).ids + [EOS]
    return all(g.accept(i) for i in ids) and g.is_terminated()


def test_tool_call_grammars_accept_the_recipe_rendering(grammars, tokenizer):
    auto = constraint_of(convert("auto"))
    required = constraint_of(convert("required"))
    with_content = rendered_assistant(CALLS, "Let me check.")
    assert accepts(grammars, auto, with_content, tokenizer)
    assert accepts(grammars, auto, rendered_assistant(CALLS, ""), tokenizer)
    assert accepts(grammars, auto, "Just an answer, no tools.", tokenizer)
    # required: the prompt ends with the block's opening, the output is the rest
    opening = "\n\n<｜DSML｜tool_calls>\n"
    assert (
        dr.DeepseekV4Encoding()
        .render_conversation(
            dr.Conversation(
                [dr.UserMessage("hi")],
                tools=[dr.ToolDefinition("add", None, {})],
                tool_choice="required",
                thinking_mode=False,
            )
        )
        .prompt.endswith("<｜Assistant｜></think>" + opening)
    )
    rest = rendered_assistant(CALLS, "").split(opening, 1)[1]
    assert accepts(grammars, required, rest, tokenizer)


def test_tool_call_grammars_reject_what_would_escape_the_schemas(grammars, tokenizer):
    auto = constraint_of(convert("auto"))
    required = constraint_of(convert("required"))
    bad_args = rendered_assistant([("get_weather", '{"city": "Paris", "unit": "kelvin"}')], "")
    assert not accepts(grammars, auto, bad_args, tokenizer)
    # the parser would turn a stray invoke in content into a tool call
    stray = 'Sure <｜DSML｜invoke name="add">\n</｜DSML｜invoke>\n'
    assert not accepts(grammars, auto, stray, tokenizer)
    text = '<｜DSML｜invoke name="nope">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    assert not accepts(grammars, required, text, tokenizer)
    assert not accepts(
        grammars, required, "Sure." + rendered_assistant(CALLS, "").split("<｜DSML｜tool_calls>\n", 1)[1], tokenizer
    )


# -- trigger tokens, forced EOS, vocabulary ------------------------------------------------------


def allowed(state) -> torch.Tensor:
    """(V,) bool: the tokens the request's grammar allows next (all, while it is inactive)."""
    bm = allocate_bitmask(1, V4_VOCAB)
    if not state.grammar.fill_mask(bm, 0):
        return torch.ones(V4_VOCAB, dtype=torch.bool)
    logits = torch.zeros(1, V4_VOCAB)
    apply_bitmask(logits, bm, [0])
    return torch.isfinite(logits[0])


def test_trigger_token_starts_the_grammar(v4_sampler, tokenizer):
    c = OutputConstraint("json", json.dumps(PET_SCHEMA), trigger_token_ids=(THINK_END,))
    st = v4_sampler.new_state(SamplingParams(temperature=0.0, max_tokens=50, constraint=c), [0])
    hello = tokenizer.encode("hello").ids[0]
    brace = tokenizer.encode("{").ids[0]

    def step(token_favoured: int) -> int:
        logits = torch.zeros(1, V4_VOCAB)
        logits[0, hello] = 5.0
        logits[0, token_favoured] = 4.0
        return v4_sampler.sample(logits, [st]).token_ids.item()

    assert allowed(st).all()  # thinking: unconstrained
    assert step(brace) == hello
    logits = torch.zeros(1, V4_VOCAB)
    logits[0, THINK_END] = 9.0
    assert v4_sampler.sample(logits, [st]).token_ids.item() == THINK_END
    mask = allowed(st)
    assert not mask[hello] and mask[brace] and not mask[EOS]
    assert step(brace) == brace  # "hello" is masked now


def test_completed_grammar_forces_eos_even_with_ignore_eos(v4_sampler, tokenizer):
    yes = tokenizer.encode("yes").ids
    assert len(yes) == 1
    st = v4_sampler.new_state(
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10, constraint=OutputConstraint("regex", "yes")),
        [0],
    )
    logits = torch.zeros(1, V4_VOCAB)
    logits[0, 100] = 9.0  # the model wants something else
    logits[0, yes[0]] = 1.0
    assert v4_sampler.sample(logits.clone(), [st]).token_ids.tolist() == yes
    assert allowed(st).nonzero().flatten().tolist() == [EOS]
    out = v4_sampler.sample(logits.clone(), [st])
    assert out.token_ids.tolist() == [EOS] and out.finish_reasons == ["stop"]


def test_added_tokens_masked_dsml_kept(grammars, tokenizer, v4_sampler):
    st = v4_sampler.new_state(SamplingParams(constraint=OutputConstraint("json", json.dumps(PET_SCHEMA))), [0])
    assert all(st.grammar.accept(t) for t in tokenizer.encode('{"name":"').ids)  # inside a string
    mask = allowed(st)
    assert mask.sum() > 100000
    user, think, dsml = 128803, THINK_END, 128825
    assert not mask[user] and not mask[think] and mask[dsml]
    assert not mask[2] and not mask[0]  # pad, BOS


def test_model_vocab_larger_than_tokenizer():
    padded = V4_VOCAB + 128
    g = GrammarCompilerCache.from_tokenizer_json(TOKENIZER_JSON, padded, [EOS])
    s = Sampler(SamplerConfig(padded, (EOS,), seed=0), g)
    st = s.new_state(SamplingParams(constraint=OutputConstraint("json", "")), [0])
    logits = torch.zeros(1, padded)
    logits[0, V4_VOCAB:] = 50.0  # the padding rows of lm_head must never win
    out = s.sample(logits, [st])
    assert out.token_ids.item() < V4_VOCAB


def test_resume_replays_the_grammar(v4_sampler, tokenizer):
    c = OutputConstraint("regex", "(ab)+")
    p = SamplingParams(temperature=0.0, constraint=c)
    st = v4_sampler.new_state(p, [0], output_token_ids=tokenizer.encode("abab").ids)
    mask = allowed(st)
    assert mask[EOS] and mask[tokenizer.encode("ab").ids[0]] and not mask[tokenizer.encode("b").ids[0]]
    with pytest.raises(ValueError):
        v4_sampler.new_state(p, [0], output_token_ids=tokenizer.encode("ba").ids)


def test_invalid_constraints_raise(grammars):
    for c in [
        OutputConstraint("json", "{not json"),
        OutputConstraint("json", '{"type": "no-such-type"}'),
        OutputConstraint("regex", "(unclosed"),
        OutputConstraint("ebnf", "root ::= missing_rule"),
        OutputConstraint("tool_call_required", "[]"),
        OutputConstraint("tool_call", '[{"type": "function", "function": {}}]'),
        OutputConstraint("bogus", "x"),  # type: ignore[arg-type]
    ]:
        with pytest.raises(InvalidConstraintError):
            grammars.compile(c)


def test_compiled_grammars_are_cached(grammars):
    c = OutputConstraint("regex", "[0-9]+")
    assert grammars.compile(c) is grammars.compile(OutputConstraint("regex", "[0-9]+"))


def test_grammar_rows_are_batch_invariant_with_fixed_logits(grammars, tokenizer):
    c = OutputConstraint("json", json.dumps(PET_SCHEMA))
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=40, constraint=c)
    others = [
        SamplingParams(temperature=0.0, max_tokens=40, constraint=OutputConstraint("regex", "[a-z]{3,30}")),
        SamplingParams(top_k=50, max_tokens=40),
        SamplingParams(min_p=0.1, max_tokens=40, constraint=c),
        SamplingParams(presence_penalty=0.5, max_tokens=40, constraint=OutputConstraint("json", "")),
    ]
    gen = torch.Generator().manual_seed(4)
    bank = torch.randn(4, V4_VOCAB, generator=gen)
    for t in ['"', '",', "}", ","]:
        bank[:, tokenizer.encode(t).ids[0]] += 8.0

    def run(order: list[int]) -> list[int]:
        s = Sampler(SamplerConfig(V4_VOCAB, (EOS,), seed=0), grammars)
        states = {k: s.new_state(target if k == 0 else others[k % 4], [0]) for k in order}
        out: list[int] = []
        for step in range(40):
            if states[0].finished:
                break
            live = [k for k in order if not states[k].finished]
            # request k's logits at step t depend on (k, t) only, not on the batch
            logits = torch.stack([torch.roll(bank[k % 4], 7 * k + 13 * step) for k in live])
            res = s.sample(logits, [states[k] for k in live])
            out.append(res.token_ids[live.index(0)].item())
        return out

    alone = run([0])
    assert alone == run([0, 1, 2, 3, 4, 5, 6, 7]) == run([5, 2, 7, 0, 4, 1, 6, 3])
    assert len(alone) > 5


def test_sparse_and_dense_grammar_paths_agree(grammars, tokenizer):
    c = OutputConstraint("json", json.dumps(PET_SCHEMA))
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(1, V4_VOCAB, generator=gen)
    results = []
    for sparse_max in (V4_VOCAB, 0):  # everything sparse / everything dense
        s = Sampler(
            SamplerConfig(V4_VOCAB, (EOS,), seed=0, logprobs_mode="processed", grammar_sparse_max=sparse_max), grammars
        )
        st = s.new_state(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5, constraint=c), [0])
        tokens, lps = [], []
        for step in range(12):
            out = s.sample(torch.roll(logits, 31 * step, 1), [st])
            tokens.append(out.token_ids.item())
            lps.append(out.logprobs[0])
        results.append((tokens, lps))
    (t1, l1), (t2, l2) = results
    assert t1 == t2
    for a, b in zip(l1, l2):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_allowed_ids_and_counts_match_the_bits():
    from engine.sampling.structured import allowed_counts, allowed_ids

    gen = torch.Generator().manual_seed(0)
    bm = torch.randint(-(2**31), 2**31 - 1, (5, 40), dtype=torch.int32, generator=gen)
    bm[bm.abs() > 2**29] = 0  # some empty words
    bm[3] = 0  # a row allowing nothing
    vocab = 40 * 32 - 7  # the last word has padding bits
    counts = allowed_counts(bm).tolist()
    ids = allowed_ids(bm, vocab, 40 * 32)
    for r in range(5):
        bits = [w * 32 + b for w, v in enumerate(bm[r].tolist()) for b in range(32) if (v >> b) & 1]
        assert counts[r] == len(bits)
        got = ids[r][ids[r] >= 0].tolist()
        assert got == [i for i in bits if i < vocab]
