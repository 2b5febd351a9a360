"""``deepserve gateway`` and ``deepserve up`` (registered by ``deepserve/cli.py``).

``gateway``: the gateway alone, in front of one engine worker or a router service
(``--engine-url``). ``up``: the embedded stack (see ``server/up.py``).
Flags fall back to ``DEEPSERVE_*`` environment variables, then to ``GatewayConfig`` defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any, AsyncIterator

from deepserve import internal_auth, internal_tls
from server import up as up_module
from server.config import GatewayConfig, add_gateway_flags, parse_served_name
from server.vllm_flags import add_vllm_flags, check_vllm_flags, engine_args


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    gw = subparsers.add_parser(
        "gateway", help="OpenAI/Anthropic-compatible gateway in front of a worker or router service",
        description=run_gateway.__doc__,
    )
    add_gateway_flags(gw)
    add_vllm_flags(gw, engine=False)
    gw.add_argument("--engine-url", metavar="URL", help="engine worker or router service (DEEPSERVE_ENGINE_URL)")
    gw.add_argument("--access-log", action="store_true", help="log every request (off: it costs CPU per request)")
    internal_auth.add_flags(gw)
    gw.set_defaults(func=run_gateway)

    up = subparsers.add_parser(
        "up", help="embedded all-in-one stack: gateway + router + engine workers + KV store",
        description=(up_module.__doc__ or "").split("\n\n")[0],
    )
    add_gateway_flags(up)
    add_vllm_flags(up, engine=True)
    up.add_argument("--dtype", help="passed to every engine worker")
    up.add_argument("--device", help="passed to every engine worker")
    up.add_argument("--dp", type=int, help="data-parallel ranks per engine worker")
    up.add_argument("--workers", type=int, default=1, help="mixed-role workers (default 1)")
    up.add_argument("--prefill-workers", type=int, default=0, help="prefill-pool workers (with --decode-workers)")
    up.add_argument("--decode-workers", type=int, default=0, help="decode-pool workers (with --prefill-workers)")
    up.add_argument("--cache-dir", help="where the tiny checkpoint and the KV files live (DEEPSERVE_CACHE_DIR)")
    up.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for the workers to become healthy")
    up.add_argument("--shutdown-timeout", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL")
    up.add_argument("--engine-arg", action="append", default=[], metavar="ARG", help="extra argument for each worker")
    up.add_argument("--access-log", action="store_true", help="log every request")
    internal_tls.add_flags(up)
    up.set_defaults(func=run_up)


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_gateway(args: argparse.Namespace) -> int:
    """Serve the gateway in front of ``--engine-url`` (an engine worker or a router service)."""
    import uvicorn

    from kvstore.config import KVStoreConfig
    from server.app import create_app
    from server.engine_client import make_engine_client
    from server.metrics import GatewayMetrics

    config = GatewayConfig.from_args(args)
    _logging(config.log_level)
    check_vllm_flags(args)
    if not config.engine_url:
        raise SystemExit("deepserve gateway: --engine-url (or DEEPSERVE_ENGINE_URL) is required")
    client = make_engine_client(config.engine_url, internal_auth.from_args(args))

    @contextlib.asynccontextmanager
    async def lifecycle() -> AsyncIterator[None]:
        try:
            yield
        finally:
            close: Any = getattr(client, "close", None) or getattr(client, "aclose", None)
            if close is not None:
                await close()

    health_url = config.engine_url.rstrip("/") + "/health"

    async def health() -> bool:
        probe = getattr(client, "health", None)
        if probe is not None:
            return bool(await probe())
        return await asyncio.to_thread(up_module.http_ok, health_url)

    async def context_len() -> int:
        load = getattr(client, "load", None)  # a worker's or router service's /load
        return (await load()).max_model_len if load is not None else 0

    gm = GatewayMetrics()
    app = create_app(
        config, client, gateway_metrics=gm, lifecycle=lifecycle, health_probe=health, kv=KVStoreConfig.from_env(),
        context_probe=context_len,
    )
    uvicorn.run(app, access_log=args.access_log, **config.uvicorn_options(on_reject=gm.reject))
    return 0


def run_up(args: argparse.Namespace) -> int:
    config = GatewayConfig.from_args(args)
    _logging(config.log_level)
    check_vllm_flags(args)
    cache_dir = Path(args.cache_dir) if args.cache_dir else up_module.UpOptions.default_cache_dir()
    opts = up_module.UpOptions(
        cache_dir=cache_dir,
        model_dir=Path(config.model_dir) if config.model_dir else None,
        mixed_workers=args.workers,
        prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers,
        dp=args.dp,
        dtype=args.dtype,
        device=args.device,
        max_model_len=config.max_model_len,
        served_model_name=parse_served_name(config.served_model_names[0], "v4")[0] if config.served_model_names else None,
        startup_timeout_s=args.startup_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        engine_args=tuple(engine_args(args) + args.engine_arg),
    )
    return up_module.run_up(opts, config, access_log=args.access_log, tls=internal_tls.from_args(args))
