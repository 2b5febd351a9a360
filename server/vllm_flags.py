"""The ``vllm serve`` flags users type, on ``deepserve up`` and ``deepserve gateway``.

Gateway flags with a vLLM spelling live in ``server.config.add_gateway_flags`` (``--served-model-name``,
``--max-model-len``, ``--api-key``, ``--uvicorn-log-level``, ``--root-path``, ``--ssl-*``,
``--allowed-origins``). This module adds the rest:
- engine flags ``deepserve up`` passes to every worker: ``--max-num-seqs``,
  ``--max-num-batched-tokens``, ``--gpu-memory-utilization``, ``--speculative-config``, ``--load-format``,
  ``--enable-prefix-caching`` / ``--no-enable-prefix-caching`` (the KV cache store on or off), and
  deepserve's ``--bounded-replay-tokens``;
- parser flags accepted with a note (tool-call and reasoning parsing are built in, from
  deepseek-recipe): ``--tool-call-parser``, ``--reasoning-parser``, ``--enable-auto-tool-choice``;
- ``--tensor-parallel-size`` / ``-tp``: 1 only (a worker spans GPUs by expert parallelism,
  ``--dp``); a larger value is refused with a message.
"""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)

_ENGINE_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "speculative_config", "load_format", "bounded_replay_tokens")


def add_vllm_flags(p: argparse.ArgumentParser, *, engine: bool) -> None:
    """Add the flags; ``engine``: also the ones passed to engine workers (``deepserve up``)."""
    p.add_argument("--tool-call-parser", metavar="NAME", help="accepted for vLLM compatibility: DSML tool calls are parsed built in")
    p.add_argument("--reasoning-parser", metavar="NAME", help="accepted for vLLM compatibility: reasoning is parsed built in")
    p.add_argument("--enable-auto-tool-choice", action="store_true", help="accepted for vLLM compatibility: tool_choice auto is always on")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="1 only (GPUs are used through --dp and expert parallelism)")
    if engine:
        p.add_argument("--max-num-seqs", type=int, help="passed to every engine worker")
        p.add_argument("--max-num-batched-tokens", type=int, help="passed to every engine worker")
        p.add_argument("--gpu-memory-utilization", type=float, help="passed to every engine worker")
        p.add_argument("--speculative-config", metavar="JSON", help='passed to every engine worker, e.g. \'{"method": "mtp", "num_speculative_tokens": 3}\'')
        p.add_argument("--load-format", choices=["auto", "dummy"], help="passed to every engine worker (dummy: random weights, no files read)")
        p.add_argument("--bounded-replay-tokens", type=int, metavar="N", help="passed to every engine worker (DeepSeek-V4.1 bounded replay)")
        p.add_argument(
            "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
            help="the workers' KV cache store (--no-enable-prefix-caching: --kv-cache off)",
        )


def check_vllm_flags(args: argparse.Namespace) -> None:
    """Refuse what cannot be honoured; note what is accepted but built in."""
    if args.tensor_parallel_size != 1:
        raise SystemExit(
            f"--tensor-parallel-size {args.tensor_parallel_size} is not supported: deepserve runs tensor "
            "parallel size 1 and spans GPUs with data-parallel attention and expert parallelism (--dp)"
        )
    for flag in ("tool_call_parser", "reasoning_parser", "enable_auto_tool_choice"):
        if getattr(args, flag, None):
            log.info("--%s: accepted; deepserve parses DeepSeek tool calls and reasoning itself", flag.replace("_", "-"))


def engine_args(args: argparse.Namespace) -> list[str]:
    """The worker flags (``deepserve engine``) the vLLM-style flags of ``deepserve up`` ask for."""
    out: list[str] = []
    for name in _ENGINE_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            out += ["--" + name.replace("_", "-"), str(value)]
    if getattr(args, "enable_prefix_caching", None) is False:
        out += ["--kv-cache", "off"]
    return out
