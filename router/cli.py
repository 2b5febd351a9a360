"""``deepserve router``: flags over ``RouterConfig`` (flags > ``DEEPSERVE_ROUTER_*`` > defaults)."""

from __future__ import annotations

import argparse
import logging

from deepserve import internal_auth
from router.config import RouterConfig
from router.policies.registry import policy_names
from router.serving import SERVERS


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("router", help="run the DP-aware router as its own service", description=__doc__)
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8100)")
    p.add_argument("--policy", choices=policy_names(), help="placement policy (default cache_aware)")
    p.add_argument("--prefill-policy", choices=policy_names(), help="policy of the prefill pool (default: --policy)")
    p.add_argument("--decode-policy", choices=policy_names(), help="policy of the decode/mixed pools (default: --policy)")
    p.add_argument("--prefill", nargs="+", action="extend", metavar="URL", help="prefill-pool workers")
    p.add_argument("--decode", nargs="+", action="extend", metavar="URL", help="decode-pool workers")
    p.add_argument("--worker", nargs="+", action="extend", metavar="URL", help="mixed (colocated) workers")
    p.add_argument("--pd-min-prompt-tokens", type=int, help="shorter prompts skip the prefill pool (default 512)")
    p.add_argument("--block-size", type=int, help="KV unit size in tokens; must match the engine (default 128)")
    p.add_argument("--fingerprint", help="model fingerprint for KV unit keys (default: from the workers' /load)")
    p.add_argument("--temperature", type=float, help="cache_aware: 0 = cheapest rank, > 0 = softmax sampling")
    p.add_argument("--max-retries", type=int, help="re-dispatches before the first token (default 3)")
    p.add_argument("--max-migrations", type=int, help="re-dispatches after tokens were streamed (default 3)")
    p.add_argument("--max-inflight-per-rank", type=int, help="requests per rank before queueing; 0 = unbounded")
    p.add_argument("--max-queue", type=int, help="admission queue bound (default 1024)")
    p.add_argument("--open-metrics", action="store_true", default=None, help="serve /metrics without the internal token")
    p.add_argument("--first-byte-timeout", dest="first_byte_timeout_s", type=float, help="seconds a worker may take to start answering (default 300)")
    p.add_argument("--event-timeout", dest="event_timeout_s", type=float, help="seconds a stream may go without an event before its worker counts as hung (default 60)")
    p.add_argument("--server", choices=SERVERS, help="the service's HTTP server: http1 (ours, default) or aiohttp (the library)")
    p.add_argument("--log-level", default="INFO")
    internal_auth.add_flags(p)
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    flags = {k: v for k, v in vars(args).items() if k not in ("func", "command", "log_level", "internal_token", "internal_token_file") and v is not None}
    return RouterConfig.from_env(**flags)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from router.service import serve

    config = config_from_args(args)
    logging.getLogger("router").info(
        "router on %s:%d policy=%s prefill=%s decode=%s mixed=%s", config.host, config.port, config.policy, config.prefill, config.decode, config.worker
    )
    serve(config, internal_auth.from_args(args))
    return 0
