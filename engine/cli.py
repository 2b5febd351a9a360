"""Engine sub-commands: ``make-tiny-model``, ``generate``, ``engine`` (a worker process)."""

from __future__ import annotations

import argparse
import os
import sys

LOAD_FORMAT_HELP = ("auto: read the checkpoint's weights; dummy (vLLM's spelling): random weights in the released V4-Flash "
                    "layout drawn on --device from config.json alone (`deepserve make-random-checkpoint --config-only`), no files read")


def _make_tiny(args: argparse.Namespace) -> int:
    from engine.model.tiny import make_tiny_model

    from engine.model.tiny_mtp import TrainConfig

    path = make_tiny_model(args.out, seed=args.seed, preset=args.preset, train_mtp=TrainConfig(seed=args.seed) if args.train_mtp else None)
    print(path)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from engine.errors import EngineError
    from engine.generate import generate, load_prompts, write_results
    from deepserve.protocol import SamplingParams
    from engine.runtime.builder import tokenizer_path

    if sum(x is not None for x in (args.prompt, args.prompt_ids, args.input)) != 1:
        print("give exactly one of --prompt, --prompt-ids, --input", file=sys.stderr)
        return 2
    try:
        prompts = load_prompts(args.prompt, args.prompt_ids, args.input, tokenizer_path(args.model))
        sampling = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            logprobs=args.top_logprobs is not None,
            top_logprobs=args.top_logprobs or 0,
        )
        rows = generate(args.model, prompts, sampling, dtype=args.dtype, device=args.device, load_format=args.load_format)
        if args.output:
            with open(args.output, "w") as f:
                write_results(rows, f)
        else:
            write_results(rows)
    except (EngineError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _engine(args: argparse.Namespace) -> int:
    from deepserve import internal_auth
    from engine.runtime.config import EngineConfig, SpeculativeConfig
    from engine.worker.server import WorkerConfig, run_worker

    if args.load_format == "dummy" and args.ep > 1:
        print("error: --load-format dummy is not supported with --ep (each rank would draw its own weights)", file=sys.stderr)
        return 2
    if args.tensor_parallel_size != 1:
        print(f"error: --tensor-parallel-size {args.tensor_parallel_size} is not supported (tensor parallel size 1; "
              "GPUs are spanned by --dp and expert parallelism)", file=sys.stderr)
        return 2
    try:
        speculative = None if args.speculative_config is None else SpeculativeConfig.from_json(args.speculative_config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine_cfg = EngineConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_queue=args.max_queue,
        state_memory_bytes=args.state_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        role=args.role,
        kv_cache="off" if args.enable_prefix_caching is False else args.kv_cache,
        snapshot_interval_units=args.snapshot_interval,
        static_decode={"auto": None, "on": True, "off": False}[args.static_decode],
        static_max_tokens=args.static_max_tokens,
        grammar_timeout_s=args.grammar_timeout,
        speculative=speculative,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        weights=args.weights,
        bounded_replay_tokens=args.bounded_replay_tokens,
        load_format=args.load_format,
    )
    run_worker(
        WorkerConfig(
            model_dir=args.model,
            host=args.host,
            port=args.port,
            role=args.role,
            dp=args.dp,
            dtype=args.dtype,
            device=args.device,
            served_model_name=args.served_model_name,
            worker_id=args.worker_id or "",
            engine=engine_cfg,
            register=tuple(args.register),
            advertise_url=args.advertise_url or "",
            auth=internal_auth.from_args(args),
            open_metrics=args.open_metrics,
            stall_timeout_s=args.stall_timeout,
            backend=args.backend,
            dp_rank=args.dp_rank,
            expert_parallel=args.ep,
        )
    )
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    from deepserve import internal_auth

    p = sub.add_parser("make-tiny-model", help="write a deterministic random tiny DeepSeek-V4 checkpoint")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="tiny", help="tiny | tiny-small-windows | tiny-v41")
    p.add_argument("--train-mtp", action="store_true",
                   help="fit the lm_head and the MTP layer (tiny-v41: the DSpark draft layers) to a synthetic language (5-10 s on a CPU core), so drafts get accepted")  # fmt: skip
    p.set_defaults(func=_make_tiny)

    g = sub.add_parser("generate", help="offline generation, one JSON object per prompt")
    g.add_argument("--model", required=True)
    g.add_argument("--prompt")
    g.add_argument("--prompt-ids", help="comma-separated token ids")
    g.add_argument("--input", help="JSONL with {'prompt': text} or {'prompt_ids': [...]} per line")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-logprobs", type=int, default=None, help="report logprobs and K alternatives")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"], help=LOAD_FORMAT_HELP)
    g.add_argument("--output")
    g.set_defaults(func=_generate)

    from engine.backends.registry import names as backend_names

    e = sub.add_parser("engine", help="run one engine worker process (one DP replica group)")
    env = os.environ.get
    e.add_argument("--model", required=True)
    e.add_argument("--role", default="mixed", choices=["prefill", "decode", "mixed"])
    e.add_argument("--host", default=env("DEEPSERVE_ENGINE_HOST", "127.0.0.1"))
    e.add_argument("--port", type=int, default=int(env("DEEPSERVE_ENGINE_PORT", "8200")))
    e.add_argument("--dp", type=int, default=1)
    e.add_argument("--backend", default=env("DEEPSERVE_ENGINE_BACKEND", "reference"), choices=backend_names(),
                   help="reference: deepserve's engine, every DP rank in this process; deepinfer: DeepInfer (SM100), one DP rank per process")  # fmt: skip
    e.add_argument("--dp-rank", type=int, default=None, help="deepinfer: the DP rank (0 .. dp-1) this process serves")
    e.add_argument("--ep", type=int, default=0,
                   help="expert-parallel size. reference: N > 1 runs N rank processes (one per GPU; gloo processes with --device cpu), "
                        "each a DP rank, the routed experts split over them; deepinfer: EP size (default: --dp)")  # fmt: skip
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    e.add_argument("--device", default="cpu")
    e.add_argument("--served-model-name", default="deepseek-v4")
    e.add_argument("--worker-id", default=None)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--long-prefill-token-threshold", type=int, default=None, metavar="N",
                   help="largest prefill chunk while other requests share the step (fair prefill; default half of --max-num-batched-tokens)")
    e.add_argument("--max-model-len", type=int, default=65536)
    e.add_argument("--max-queue", type=int, default=4096, help="requests a rank holds (running and waiting) before it answers 503 engine_full")
    e.add_argument("--state-memory-bytes", type=int, default=2 << 30)
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--kv-cache", default=env("DEEPSERVE_KV_CACHE", "readwrite"), choices=["off", "read", "write", "readwrite"])
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="vLLM spelling: --no-enable-prefix-caching is --kv-cache off")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="1 only (vLLM spelling; use --dp)")
    e.add_argument("--static-decode", default="auto", choices=["auto", "on", "off"],
                   help="decode through slot pools: CUDA graphs on GPU, host slots on CPU (auto: on, general path if the pools cannot be built)")  # fmt: skip
    e.add_argument("--static-max-tokens", type=int, default=8192, help="tokens per static decode slot")
    e.add_argument("--load-format", default="auto", choices=["auto", "dummy"], help=LOAD_FORMAT_HELP)
    e.add_argument("--weights", default="auto", choices=["auto", "native", "dequantized"],
                   help="the checkpoint's FP8 linears / FP4 experts kept as stored (native: FP8/FP4 kernels) or dequantized "
                   "to --dtype (auto: native on CUDA when the checkpoint stores them)")  # fmt: skip
    e.add_argument(
        "--grammar-timeout", type=float, default=10.0, metavar="S",
        help="seconds a request waits for its structured-output grammar to compile (then it fails as invalid)",
    )
    e.add_argument("--speculative-config", default=env("DEEPSERVE_SPECULATIVE_CONFIG"), metavar="JSON",
                   help='speculative decoding with the checkpoint\'s MTP layer (vLLM spelling): \'{"method": "mtp", "num_speculative_tokens": 3}\'')  # fmt: skip
    e.add_argument("--snapshot-interval", type=int, default=1, help="store a boundary snapshot every N units while decoding")
    e.add_argument("--bounded-replay-tokens", type=int, default=0, metavar="N",
                   help="DeepSeek-V4.1: a prefix resumed from KV blocks without a snapshot replays its decoder (ratio-1) layers "
                   "over only its last N tokens (DeepInfer's YOCO KEEP_TOKENS, at least the window; approximate); 0 = exact replay")  # fmt: skip
    e.add_argument("--register", action="append", default=[], metavar="ROUTER_URL", help="register with this router service (repeatable); deregister on drain")
    e.add_argument("--advertise-url", default=None, help="URL routers should use for this worker (default http://HOST:PORT)")
    e.add_argument("--stall-timeout", type=float, default=120.0, help="seconds the engine thread may go without a turn while it has work before /health turns 503")
    internal_auth.add_flags(e, metrics=True)
    e.set_defaults(func=_engine)
