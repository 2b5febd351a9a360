"""Request-body JSON schemas for the OpenAPI document (``/openapi.json``).

The handlers validate bodies themselves (deepseek-recipe for the chat protocols, ``routes/
completions.py`` for Completions) and never through these schemas, so the hot path builds no
pydantic model per request. The schemas are deliberately loose descriptions of the main fields:
they document the API and give the schemathesis fuzz run realistic inputs.
"""

from __future__ import annotations

from typing import Any

_STR_OR_STRS = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]}
_TEXT_CONTENT = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
                "required": ["type", "text"],
            },
        },
    ]
}
_TOOLS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "type": {"type": "string", "enum": ["function"]},
            "function": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "description": {"type": "string"},
                    "parameters": {"type": "object"},
                },
                "required": ["name"],
            },
        },
        "required": ["type", "function"],
    },
}

CHAT_COMPLETIONS: dict[str, Any] = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string"},
        "messages": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
                    "content": _TEXT_CONTENT,
                    "reasoning_content": {"type": "string"},
                    "tool_call_id": {"type": "string"},
                },
                "required": ["role", "content"],
            },
        },
        "max_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "stop": _STR_OR_STRS,
        "seed": {"type": "integer", "minimum": 0},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "response_format": {
            "type": "object",
            "properties": {
                "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
                "json_schema": {"type": "object"},
            },
            "required": ["type"],
        },
        "tools": _TOOLS,
        "tool_choice": {"anyOf": [{"type": "string", "enum": ["auto", "none", "required"]}, {"type": "object"}]},
        "thinking": {"type": "object", "properties": {"type": {"type": "string", "enum": ["enabled", "disabled"]}}},
        "reasoning_effort": {"type": "string", "enum": ["low", "high", "xhigh", "max"]},
        "user": {"type": "string"},
    },
}

COMPLETIONS: dict[str, Any] = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        "model": {"type": "string"},
        "prompt": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
                {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                {
                    "type": "array",
                    "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                    "minItems": 1,
                },
            ]
        },
        "max_tokens": {"type": "integer", "minimum": 0},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "n": {"type": "integer", "minimum": 1, "maximum": 1},
        "best_of": {"type": "integer", "minimum": 1, "maximum": 1},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        "echo": {"type": "boolean"},
        "stop": _STR_OR_STRS,
        "seed": {"type": "integer", "minimum": 0},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "user": {"type": "string"},
    },
}

RESPONSES: dict[str, Any] = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": {"type": "string"},
        "input": {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
                            "content": {"type": "string"},
                        },
                        "required": ["role", "content"],
                    },
                },
            ]
        },
        "instructions": {"type": "string"},
        "max_output_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "stream": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        "reasoning": {"type": "object", "properties": {"effort": {"type": "string"}}},
        "tools": {"type": "array", "items": {"type": "object"}},
    },
}

MESSAGES: dict[str, Any] = {
    "type": "object",
    "required": ["model", "messages", "max_tokens"],
    "properties": {
        "model": {"type": "string"},
        "max_tokens": {"type": "integer", "minimum": 1},
        "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "messages": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "role": {"type": "string", "enum": ["user", "assistant"]},
                    "content": _TEXT_CONTENT,
                },
                "required": ["role", "content"],
            },
        },
        "stream": {"type": "boolean"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0},
        "stop_sequences": {"type": "array", "items": {"type": "string"}},
        "thinking": {
            "type": "object",
            "properties": {"type": {"type": "string", "enum": ["enabled", "disabled"]}, "budget_tokens": {"type": "integer"}},
        },
        "tools": {"type": "array", "items": {"type": "object"}},
    },
}

_ERROR = {
    "description": "OpenAI-shaped error",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {
                    "error": {
                        "type": "object",
                        "properties": {
                            "message": {"type": "string"},
                            "type": {"type": "string"},
                            "param": {"type": ["string", "null"]},
                            "code": {"type": ["string", "null"]},
                        },
                        "required": ["message", "type"],
                    }
                },
            }
        }
    },
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: _ERROR for status in (400, 401, 404, 408, 413, 429, 502, 503, 504)
}


def json_body(schema: dict[str, Any]) -> dict[str, Any]:
    """``openapi_extra`` declaring a required JSON request body with ``schema``."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
