"""Which top-level request fields each endpoint accepts: no field is ever silently dropped.

Every endpoint has a table of the fields it honours (each with the one-line behaviour that
``docs/API.md`` shows) and a table of fields it accepts only at their "off" value (``store:
false``, ``modalities: ["text"]`` ...), which it refuses otherwise. Any other field is refused
with 400 ``Unrecognized request argument supplied: NAME`` and ``param: NAME``, as OpenAI does.
A ``null`` value counts as absent (many clients send every optional field as ``null``).

Structured-output fields are listed here so they pass the check; their meaning lives with the
structured-output code.
"""

from __future__ import annotations

from typing import Any, Mapping

from server.errors import InvalidRequest

Table = Mapping[str, str]  # field -> behaviour (one line, shown in docs/API.md)
OffValues = Mapping[str, tuple[Any, ...]]  # field -> the values that mean "not used"

# ---- shared pieces ------------------------------------------------------------------------------
METADATA: Table = {
    "user": "session-affinity key for the router; not stored",
    "safety_identifier": "session-affinity key for the router; not stored",
    "prompt_cache_key": "session-affinity key for the router (same prefix, same worker)",
    "metadata": "accepted and ignored (client bookkeeping; nothing is stored)",
}
SAMPLING: Table = {
    "temperature": "sampling temperature; 0 is greedy (in thinking mode too, unless the server aligns with the official API)",
    "top_p": "nucleus sampling",
    "top_k": "vLLM: keep the k most likely tokens (0 or -1: off)",
    "min_p": "vLLM: drop tokens below min_p x the top probability",
    "presence_penalty": "OpenAI presence penalty over output tokens",
    "frequency_penalty": "OpenAI frequency penalty over output tokens",
    "repetition_penalty": "vLLM repetition penalty over prompt + output",
    "seed": "seeded sampling stream (any int64; a negative one taken mod 2^63); choice i of n uses seed + i",
    "logit_bias": "token id -> bias in [-100, 100], added to the logits",
    "min_tokens": "vLLM: EOS and stop_token_ids are impossible before this many tokens",
    "stop_token_ids": "vLLM: more token ids that end the answer (the id stays in the output unless special)",
    "ignore_eos": "vLLM: keep generating past EOS (until max_tokens or a stop)",
    "skip_special_tokens": "vLLM: drop special tokens (BOS, EOS, pad, placeholders) from the text; default true",
    "include_stop_str_in_output": "vLLM: the matched stop string stays at the end of the text",
    "priority": "vLLM: scheduling priority, lower first (router and engine queues)",
    "truncate_prompt_tokens": "vLLM: only the last k prompt tokens are used (-1: the context length)",
    "prompt_logprobs": "vLLM: 0-20 (true: 1): per prompt token its logprob and rank and the k best, the first null (chat: on the answer, completions: on each choice; not with stream; the whole prompt is computed: no prefix-cache hit)",
    "stream": "server-sent events",
    "stream_options": "include_usage (final chunk with choices: [] and usage), continuous_usage_stats (usage on every chunk)",
    "stop": "up to 16 stop strings, matched across token boundaries",
    "n": "n choices, each its own engine request (seed + i when seeded); usage summed",
}
STRUCTURED: Table = {
    "response_format": "structured output: text, json_object (a JSON object), json_schema (the client's own schema; strict as OpenAI means it; a keyword the grammar cannot enforce: 400 naming it)",
    "guided_json": "vLLM: the output follows this JSON schema (an object or JSON text; audited as response_format)",
    "guided_regex": "vLLM: the output matches this regular expression (xgrammar)",
    "guided_choice": "vLLM: the output is exactly one of these strings",
    "guided_grammar": "vLLM: the output follows this xgrammar EBNF grammar (a root rule)",
    "guided_decoding_backend": "vLLM: xgrammar or auto (the backend); any other: 400",
    "guided_whitespace_pattern": "vLLM: 400 unless null (xgrammar has no whitespace pattern; use structured_outputs.disable_any_whitespace)",
    "structured_outputs": "vLLM: one of json, regex, choice, grammar, json_object; disable_any_whitespace (compact JSON), disable_additional_properties, disable_fallback; whitespace_pattern, structural_tag: 400",
    "regex": "SGLang: the output matches this regular expression",
    "ebnf": "SGLang: the output follows this xgrammar EBNF grammar",
}
# vLLM / SGLang fields accepted only at the value that changes nothing.
VLLM_OFF: OffValues = {
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "spaces_between_special_tokens": (True,),
    "allowed_token_ids": (),
    "bad_words": ((), []),
    "logits_processors": ((), []),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "cache_salt": (),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    "lora_path": (),
    "return_hidden_states": (False,),
    "no_stop_trim": (False,),
    "separate_reasoning": (True,),
    "stream_reasoning": (True,),
}
OPENAI_OFF: OffValues = {
    "store": (False,),
    "service_tier": ("auto", "default"),
}

# ---- per endpoint ---------------------------------------------------------------------------------
CHAT: Table = {
    "model": "a served model name (GET /v1/models)",
    "messages": "system, developer (= system), user, assistant, tool; text content only (images: 400)",
    "max_tokens": "output token limit; default: the recipe's (8192, thinking 65536), clamped to the context left",
    "max_completion_tokens": "same as max_tokens (wins when both are sent)",
    "logprobs": "log probability of each output token",
    "top_logprobs": "0-20 alternatives per token (needs logprobs)",
    "tools": "function tools (DSML tool-call grammar)",
    "tool_choice": "auto, none, required, or a named function",
    "parallel_tool_calls": "false: at most one tool call is returned",
    "thinking": "DeepSeek: {type: enabled|disabled}",
    "reasoning_effort": "DeepSeek thinking effort: low, high, xhigh, max",
    "chat_template_kwargs": "vLLM/SGLang: thinking / enable_thinking (bool) select the thinking mode",
    "echo": "vLLM: the last message, when it is the assistant's, is prepended to the answer",
    "add_generation_prompt": "vLLM: true only (the encoding always opens the assistant turn)",
    **SAMPLING,
    **STRUCTURED,
    **METADATA,
}
CHAT_OFF: OffValues = {
    **VLLM_OFF,
    **OPENAI_OFF,
    "modalities": (("text",), ["text"]),
    "continue_final_message": (False,),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
    "functions": (),
    "function_call": (),
    "verbosity": ("medium",),
    "documents": (),
    "chat_template": (),
    "mm_processor_kwargs": (),
    "request_id": (),
}
COMPLETIONS: Table = {
    "model": "a served model name",
    "prompt": "a text, a list of texts, a token-id list, or a list of token-id lists (one choice each)",
    "max_tokens": "output token limit (default 16); 0 with echo returns the prompt only (scored when logprobs or prompt_logprobs ask)",
    "logprobs": "0-20: legacy logprobs (tokens, token_logprobs, top_logprobs, text_offset)",
    "echo": "the prompt is prepended to each choice; with logprobs its tokens come scored (the first null)",
    "best_of": "best_of candidates per prompt, the n with the highest summed logprob returned (not with stream)",
    "add_special_tokens": "vLLM: false sends text prompts without the BOS token",
    **SAMPLING,
    **STRUCTURED,
    **METADATA,
}
COMPLETIONS_OFF: OffValues = {**VLLM_OFF, **OPENAI_OFF, "suffix": ("",), "prompt_embeds": (), "request_id": ()}
RESPONSES: Table = {
    "model": "a served model name",
    "input": "a text or input items (messages, function calls and outputs); text only (images: 400)",
    "instructions": "system prompt",
    "max_output_tokens": "output token limit",
    "temperature": SAMPLING["temperature"],
    "top_p": SAMPLING["top_p"],
    "top_logprobs": "0-20 alternatives per token",
    "stream": "named server-sent events (response.*)",
    "reasoning": "effort: DeepSeek thinking effort; max_tokens: reasoning cap (the reasoning ends after this many tokens); summary: accepted (the full reasoning is the reasoning item's content); other keys: 400",
    "tools": "function tools (and namespaces)",
    "tool_choice": "auto, none, required, or a named function",
    "parallel_tool_calls": "false: at most one function call is returned",
    "text": "text.format: text, json_object, json_schema (structured output); text.verbosity: 400 unless \"medium\" or null",
    "store": "default true: the response is kept (the shared Redis or this gateway's LRU, with a TTL: --responses-store) for GET/DELETE /v1/responses/{id} and previous_response_id",
    "previous_response_id": "continue a stored response's conversation (its input and output items before this input; its instructions are not carried over); unknown: 404",
    "background": "true (needs store; not with stream): answered at once with status queued; poll GET /v1/responses/{id}; POST /v1/responses/{id}/cancel",
    **METADATA,
}
RESPONSES_OFF: OffValues = {
    "service_tier": OPENAI_OFF["service_tier"],
    # reasoning items always carry encrypted_content: asking for it changes nothing
    "include": ((), [], ["reasoning.encrypted_content"]),
    "truncation": ("disabled",),
    "max_tool_calls": (),
    "conversation": (),
    "prompt": (),
    "stream_options": (),
}
MESSAGES: Table = {
    "model": "a served model name",
    "messages": "user and assistant turns; text, tool_use, tool_result, thinking blocks (images, documents: 400)",
    "max_tokens": "required (400 without it): output token limit",
    "system": "system prompt (text or text blocks)",
    "stop_sequences": "stop strings",
    "stream": "named events (message_start ...)",
    "temperature": "sampling temperature (0-1)",
    "top_p": "nucleus sampling",
    "top_k": "keep the k most likely tokens",
    "thinking": "{type: enabled|disabled, budget_tokens}: budget_tokens caps the reasoning (it ends after that many tokens)",
    "tools": "client tools",
    "tool_choice": "auto, any, tool, none",
    "metadata": "metadata.user_id: session-affinity key for the router",
}
MESSAGES_OFF: OffValues = {
    "service_tier": ("auto", "standard_only"),
    "container": (),
    "mcp_servers": ((), []),
    "context_management": (),
}
COUNT_TOKENS: Table = {k: v for k, v in MESSAGES.items() if k in ("model", "messages", "system", "tools", "tool_choice", "thinking")}
TOKENIZE: Table = {
    "model": "optional: a served model name (default: the first)",
    "prompt": "the text to tokenize",
    "add_special_tokens": "default true: BOS first, as /v1/completions encodes text prompts",
    "return_token_strs": "also answer each token's text",
}
TOKENIZE_CHAT: Table = {
    "model": TOKENIZE["model"],
    "messages": "a chat, rendered as /v1/chat/completions renders it",
    "return_token_strs": TOKENIZE["return_token_strs"],
    **{k: CHAT[k] for k in ("tools", "tool_choice", "thinking", "reasoning_effort", "chat_template_kwargs", "add_generation_prompt", "response_format")},
}
DETOKENIZE: Table = {"model": TOKENIZE["model"], "tokens": "token ids to turn into text"}

ENDPOINTS: dict[str, tuple[Table, OffValues]] = {
    "/v1/chat/completions": (CHAT, CHAT_OFF),
    "/v1/completions": (COMPLETIONS, COMPLETIONS_OFF),
    "/v1/responses": (RESPONSES, RESPONSES_OFF),
    "/v1/messages": (MESSAGES, MESSAGES_OFF),
    "/v1/messages/count_tokens": (COUNT_TOKENS, {}),
    "/v1/chat/completions/render": (CHAT, CHAT_OFF),
    "/tokenize": (TOKENIZE, {}),
    "/tokenize (chat)": (TOKENIZE_CHAT, {"add_special_tokens": (False,), "continue_final_message": (False,)}),
    "/detokenize": (DETOKENIZE, {}),
}


def check_fields(body: dict[str, Any], route: str) -> None:
    """400 naming the first field ``route`` neither honours nor accepts at the value sent."""
    accepted, off = ENDPOINTS[route]
    for name, value in body.items():
        if name in accepted or value is None:
            continue
        if name not in off:
            raise InvalidRequest(f"Unrecognized request argument supplied: {name}", param=name, code="unknown_parameter")
        if not any(_same(value, v) for v in off[name]):
            allowed = " or ".join(repr(v) for v in off[name]) or "null"
            raise InvalidRequest(
                f"'{name}' is not supported by this server (accepted: {allowed}).", param=name, code="unsupported_parameter"
            )


def _same(value: Any, off: Any) -> bool:
    """Equal, without ``True == 1`` passing for a boolean setting (or ``1`` for ``True``)."""
    return type(value) is type(off) and value == off or (
        isinstance(value, (int, float)) and isinstance(off, (int, float))
        and not isinstance(value, bool) and not isinstance(off, bool) and value == off
    )
