"""Our router side by side with the peer routers, in front of the same fake workers, in one run.

Routers: ``deepserve`` (``deepserve router``, engine protocol: token ids in, NDJSON events out),
``vllm-router`` and ``sglang-router`` (PyPI wheels, OpenAI HTTP in and out), and ``direct`` (the
client talks to a worker itself: the baseline that "added latency" is measured against). Every
router gets fresh fake workers (``bench/fake_openai_worker.py``, cold caches), the same workload
and the same client, and the runs are interleaved in one invocation so machine noise hits all.

Scenarios (``--scenarios``):
- ``throughput``: instant workers, non-streaming, 1 output token, concurrency 32: requests/s,
  the router's per-request overhead.
- ``latency``: streaming, workers with TTFT 5 ms and ITL 1 ms, 16 tokens, concurrency 8: TTFT and
  end-to-end latency added over direct.
- ``cache``: a generated multi-turn trace (shared system prompts, sessions), 4 workers with a
  prefix cache and a prefill cost per uncached token, streaming, concurrency 16, each router's
  cache-aware policy and round-robin: cache hit rate and TTFT.

Besides the client-side numbers, each run records the CPU time per request of the router process
(with its child processes), of the fake workers and of the client (``/proc``): on a small shared
box req/s depends on how the OS shares the cores between client, router and workers, the
router's CPU per request does not.

Run: ``python -m bench.peer_routers --output bench/results/peers.json`` (prints a Markdown table).
Only the throughput scenario, both our policies, ten short interleaved rounds (each round starts
one run later in the order, so no router always runs first), with median and interquartile range
of router CPU µs/request and req/s, and their per-round ratios against vllm-router's round-robin:
``python -m bench.peer_routers --scenarios throughput --policies round_robin cache_aware --routers
deepserve vllm-router --repeat 10``. ``--pin-router/--pin-workers/--pin-client CPUS`` pin the
processes with ``taskset -c`` (client: ``sched_setaffinity``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from bench import procs
from bench.client import ClientConfig, Pacing, run_async, warmup_async
from bench.report import machine_info, summarize
from bench.workloads import make_workload

ROUTERS = ("deepserve", "vllm-router", "sglang-router", "direct")
PEER_POLICY = {"cache_aware": "cache_aware", "round_robin": "round_robin"}


@dataclass(frozen=True)
class Scenario:
    name: str
    workload: str
    num_requests: int
    concurrency: int
    stream: bool
    workers: int
    worker_args: tuple[str, ...]
    policies: tuple[str, ...] = ("round_robin",)
    description: str = ""
    added: bool = True  # "added latency" over direct is meaningful (no cache effects in the timings)


SCENARIOS: dict[str, Scenario] = {
    "throughput": Scenario("throughput", "fixed:input_length=128,output_length=1", 3000, 32, False, 2, (),
                           description="instant workers, non-streaming, 128-token prompts, 1 output token, concurrency 32"),
    "latency": Scenario("latency", "fixed:input_length=256,output_length=16", 800, 8, True, 2, ("--ttft", "0.005", "--itl", "0.001"),
                        description="streaming, worker TTFT 5 ms + ITL 1 ms, 16 tokens, concurrency 8"),
    "cache": Scenario("cache", "multi_turn:num_sessions=150,session_rate=50,output_median=16,max_output=32,think_time_s=0.5,block_size=512",
                      500, 16, True, 4, ("--itl", "0.002", "--prefill-per-token", "2e-5", "--block-size", "128"),
                      policies=("cache_aware", "round_robin"), added=False,
                      description="multi-turn trace (shared system prompts), 4 workers with prefix caches and 20 us per uncached prompt token, concurrency 16"),
}


def versions() -> dict[str, str]:
    out = {}
    for dist in ("sglang-router", "vllm-router", "aiohttp", "deepserve"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    out["python"] = sys.version.split()[0]
    return out


def router_cmd(router: str, port: int, workers: list[str], policy: str) -> tuple[list[str], str, str]:
    """(command, health URL, client endpoint) of one router in front of ``workers``."""
    bindir = Path(sys.executable).parent
    if router == "deepserve":
        cmd = [str(bindir / "deepserve"), "router", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
               "--worker", *workers, "--log-level", "WARNING"]
        return cmd, f"http://127.0.0.1:{port}/health", "internal"
    if router == "vllm-router":
        cmd = [str(bindir / "vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
               "--policy", PEER_POLICY[policy], "--worker-startup-check-interval", "1", "--prometheus-port", str(procs.free_port()),
               "--log-level", "warning"]
        return cmd, f"http://127.0.0.1:{port}/health", "chat"
    if router == "sglang-router":
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
               "--policy", PEER_POLICY[policy], "--worker-startup-check-interval", "1", "--prometheus-port", str(procs.free_port()),
               "--log-level", "warn"]
        return cmd, f"http://127.0.0.1:{port}/health", "chat"
    raise ValueError(router)


def cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid`` (all its threads) and its children (Linux): the run time
    in nanoseconds of each thread (``/proc/PID/task/TID/schedstat``), or clock ticks of 10 ms
    (``/proc/PID/stat``) where schedstat is missing; a 3,000-request run at ~100 µs/request is
    300 ms of CPU, too few ticks for a per-request figure to the microsecond."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry) == pid or int(fields[1]) == pid:  # fields[1]: the parent pid
            try:
                total += sum(int(Path(f"/proc/{entry}/task/{t}/schedstat").read_text().split()[0]) for t in os.listdir(f"/proc/{entry}/task")) / 1e9
            except (OSError, ValueError, IndexError):
                total += (int(fields[11]) + int(fields[12])) / tick
    return total


@dataclass
class Result:
    scenario: str
    router: str
    policy: str
    summary: dict
    command: list[str] = field(default_factory=list)
    round: int = 0


@dataclass(frozen=True)
class Pinning:
    """CPU lists for ``taskset -c`` (None: not pinned): the router, the fake workers, the client."""

    router: str | None = None
    workers: str | None = None
    client: str | None = None

    def wrap(self, cmd: list[str], cpus: str | None) -> list[str]:
        return ["taskset", "-c", cpus, *cmd] if cpus else cmd

    def describe(self) -> str:
        return ", ".join(f"{k} on CPU {v}" for k, v in self.__dict__.items() if v) or "not pinned"


def run_one(sc: Scenario, router: str, policy: str, log_dir: Path, say: Callable[[str], None], pin: Pinning = Pinning(), rnd: int = 0) -> Result:
    wl = make_workload(sc.workload, sc.num_requests, seed=0)
    ports = [procs.free_port() for _ in range(sc.workers)]
    workers = [
        procs.start(pin.wrap(procs.fake_worker_cmd(p, *sc.worker_args, "--worker-id", f"w{i}"), pin.workers), f"http://127.0.0.1:{p}/health", log_dir / f"worker{i}.log")
        for i, p in enumerate(ports)
    ]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    proc = None
    cmd: list[str] = []
    try:
        if router == "direct":
            url, endpoint = urls[0], "chat"
        else:
            port = procs.free_port()
            cmd, health, endpoint = router_cmd(router, port, urls, policy)
            cmd = pin.wrap(cmd, pin.router)
            proc = procs.start(cmd, health, log_dir / f"{router}.log", timeout=90)
            url = f"http://127.0.0.1:{port}"
            time.sleep(1.5)  # first load / KV-event polls
        cfg = ClientConfig(url=url, endpoint=endpoint, stream=sc.stream, block_size=wl.block_size, timeout_s=120)
        asyncio.run(warmup_async(cfg, 4))
        cpu0 = (cpu_seconds(proc.pid) if proc else 0.0, sum(cpu_seconds(w.pid) for w in workers), time.process_time())
        res = asyncio.run(run_async(wl.rows, cfg, Pacing(concurrency=sc.concurrency)))
        cpu1 = (cpu_seconds(proc.pid) if proc else 0.0, sum(cpu_seconds(w.pid) for w in workers), time.process_time())
        s = summarize(res)
        n = max(1, len(res.samples))
        s["cpu_us_per_req"] = {k: round(1e6 * (b - a) / n, 1) for k, a, b in zip(("router", "workers", "client"), cpu0, cpu1)}
        say(f"  {sc.name:<10} {router:<14} {policy:<12} {s['request_throughput']:8.1f} req/s  TTFT p50 {s['ttft_s']['p50'] * 1e3 if s['ttft_s']['p50'] else float('nan'):7.2f} ms"
            f"  hit {s['cache_hit_rate'] if s['cache_hit_rate'] is not None else float('nan'):.3f}  errors {s['errors'] or 'none'}"
            f"  CPU us/req router {s['cpu_us_per_req']['router']:.0f} workers {s['cpu_us_per_req']['workers']:.0f} client {s['cpu_us_per_req']['client']:.0f}")
        return Result(sc.name, router, policy, s, cmd, rnd)
    finally:
        if proc is not None:
            procs.stop(proc)
        for w in workers:
            procs.stop(w)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}"


def markdown(results: list[Result]) -> str:
    lines = []
    for sc in dict.fromkeys(r.scenario for r in results):
        rs = [r for r in results if r.scenario == sc]
        lines += [f"**{sc}** — {SCENARIOS[sc].description}", ""]
        if not SCENARIOS[sc].added:
            lines += ["(direct = one worker, so one cache: not a latency baseline here)", ""]
        lines.append("| router | policy | req/s | TTFT p50 / p99 (ms) | E2E p50 / p99 (ms) | added TTFT p50 / p99 (ms) | added E2E p50 / p99 (ms) | router CPU µs/req | cache hit | req/s vs ours | added p50 vs ours | hit vs ours | errors |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        direct = next((r.summary for r in rs if r.router == "direct"), None)
        for r in rs:
            s = r.summary
            ours = next((o.summary for o in rs if o.router == "deepserve" and o.policy == r.policy), None)

            def added(key: str, stat: str, summ: dict | None = s, base: dict | None = direct, sc: str = sc) -> float | None:
                if not SCENARIOS[sc].added or base is None or summ is None or summ[key][stat] is None or base[key][stat] is None:
                    return None
                return summ[key][stat] - base[key][stat]

            hit = s["cache_hit_rate"]
            lines.append(
                f"| {r.router} | {r.policy if r.router != 'direct' else '-'} | {s['request_throughput']:.0f} | "
                f"{_ms(s['ttft_s']['p50'])} / {_ms(s['ttft_s']['p99'])} | {_ms(s['e2e_s']['p50'])} / {_ms(s['e2e_s']['p99'])} | "
                f"{_ms(added('ttft_s', 'p50'))} / {_ms(added('ttft_s', 'p99'))} | {_ms(added('e2e_s', 'p50'))} / {_ms(added('e2e_s', 'p99'))} | "
                f"{s['cpu_us_per_req']['router'] if r.router != 'direct' else '-'} | {'-' if hit is None else f'{hit:.1%}'} | "
                f"{_ratio(s['request_throughput'], ours['request_throughput'] if ours else None)} | "
                f"{_ratio(added('e2e_s' if not SCENARIOS[sc].stream else 'ttft_s', 'p50'), added('e2e_s' if not SCENARIOS[sc].stream else 'ttft_s', 'p50', ours))} | "
                f"{_ratio(hit, ours['cache_hit_rate'] if ours else None)} | {', '.join(f'{k}:{v}' for k, v in s['errors'].items()) or 'none'} |"
            )
        lines.append("")
    return "\n".join(lines)


def ranges(results: list[Result], reference: str = "vllm-router") -> str:
    """Per scenario, router and policy over the repeated rounds: req/s and router CPU per request
    (min-max), and the per-round ratios against ``reference``'s round_robin in the same round."""
    lines = [f"| scenario | router | policy | rounds | req/s | router CPU µs/req | req/s vs {reference} round_robin | CPU vs {reference} round_robin |",
             "|---|---|---|---|---|---|---|---|"]
    keys = list(dict.fromkeys((r.scenario, r.router, r.policy) for r in results))
    for sc, router, policy in keys:
        mine = [r for r in results if (r.scenario, r.router, r.policy) == (sc, router, policy)]
        refs = [r for r in results if (r.scenario, r.router, r.policy) == (sc, reference, "round_robin")]
        rps = [r.summary["request_throughput"] for r in mine]
        cpu = [r.summary["cpu_us_per_req"]["router"] for r in mine]
        ref_of = {r.round: r for r in refs}
        pairs = [(a, ref_of[a.round]) for a in mine if a.round in ref_of]  # same round (runs are interleaved)
        rr = [a.summary["request_throughput"] / b.summary["request_throughput"] for a, b in pairs]
        cr = [a.summary["cpu_us_per_req"]["router"] / b.summary["cpu_us_per_req"]["router"] for a, b in pairs if b.summary["cpu_us_per_req"]["router"]]

        def span(xs: list[float], fmt: str) -> str:
            return "-" if not xs else f"{min(xs):{fmt}}–{max(xs):{fmt}}" if len(xs) > 1 else f"{xs[0]:{fmt}}"

        lines.append(f"| {sc} | {router} | {policy if router != 'direct' else '-'} | {len(mine)} | {span(rps, ',.0f')} | "
                     f"{span(cpu, '.0f') if router != 'direct' else '-'} | {span(rr, '.2f')} | {span(cr, '.2f') if router != 'direct' else '-'} |")
    return "\n".join(lines) + "\n"


def _cpu_set(cpus: str) -> set[int]:
    """``"0,2-3"`` -> {0, 2, 3} (taskset's list syntax)."""
    out: set[int] = set()
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3), linear interpolation between order statistics."""
    xs = sorted(xs)

    def q(p: float) -> float:
        i = p * (len(xs) - 1)
        lo = int(i)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)

    return q(0.25), q(0.5), q(0.75)


def _mq(xs: list[float], fmt: str) -> str:
    if not xs:
        return "-"
    q1, med, q3 = _quartiles(xs)
    return f"{med:{fmt}} [{q1:{fmt}}–{q3:{fmt}}]" if len(xs) > 1 else f"{med:{fmt}}"


def stats(results: list[Result], reference: str = "vllm-router") -> list[dict]:
    """Per (scenario, router, policy) over the rounds: medians and quartiles of req/s, router CPU
    µs/request and added TTFT p50 (over direct of the same round), and of the per-round ratios
    against ``reference``'s round_robin in the same round."""
    out = []
    for sc, router, policy in dict.fromkeys((r.scenario, r.router, r.policy) for r in results):
        mine = [r for r in results if (r.scenario, r.router, r.policy) == (sc, router, policy)]
        ref = {r.round: r.summary for r in results if (r.scenario, r.router, r.policy) == (sc, reference, "round_robin")}
        direct = {r.round: r.summary for r in results if (r.scenario, r.router) == (sc, "direct")}
        rps = [r.summary["request_throughput"] for r in mine]
        cpu = [r.summary["cpu_us_per_req"]["router"] for r in mine] if router != "direct" else []
        rps_ratio = [r.summary["request_throughput"] / ref[r.round]["request_throughput"] for r in mine if r.round in ref]
        cpu_ratio = [r.summary["cpu_us_per_req"]["router"] / ref[r.round]["cpu_us_per_req"]["router"]
                     for r in mine if r.round in ref and ref[r.round]["cpu_us_per_req"]["router"] and router != "direct"]
        added = [r.summary["ttft_s"]["p50"] - direct[r.round]["ttft_s"]["p50"] for r in mine
                 if SCENARIOS[sc].stream and SCENARIOS[sc].added and r.round in direct and r.summary["ttft_s"]["p50"] is not None
                 and direct[r.round]["ttft_s"]["p50"] is not None and router != "direct"]
        out.append({"scenario": sc, "router": router, "policy": policy if router != "direct" else "-", "rounds": len(mine),
                    "req_per_s": rps, "cpu_us_per_req": cpu, "req_per_s_vs_ref": rps_ratio, "cpu_vs_ref": cpu_ratio,
                    "added_ttft_p50_s": added})
    return out


def stats_markdown(rows: list[dict], reference: str = "vllm-router") -> str:
    """``stats`` as a table: median [q1–q3] of every measure."""
    lines = [f"| scenario | router | policy | rounds | router CPU µs/req | CPU vs {reference} RR | req/s | req/s vs {reference} RR | added TTFT p50 (ms) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['router']} | {r['policy']} | {r['rounds']} | {_mq(r['cpu_us_per_req'], '.0f')} | "
                     f"{_mq(r['cpu_vs_ref'], '.2f')} | {_mq(r['req_per_s'], ',.0f')} | {_mq(r['req_per_s_vs_ref'], '.2f')} | "
                     f"{_mq([1e3 * x for x in r['added_ttft_p50_s']], '.2f')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), default=["throughput", "latency", "cache"])
    ap.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    ap.add_argument("--num-requests", type=int, default=None, help="override each scenario's request count")
    ap.add_argument("--policies", nargs="+", choices=sorted(PEER_POLICY), default=None, help="override each scenario's policies")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every (scenario, policy, router) run, interleaved")
    ap.add_argument("--pin-router", default=None, metavar="CPUS", help="taskset -c CPUS for the router process")
    ap.add_argument("--pin-workers", default=None, metavar="CPUS", help="taskset -c CPUS for the fake workers")
    ap.add_argument("--pin-client", default=None, metavar="CPUS", help="CPU affinity of this process (the load client)")
    ap.add_argument("--output", default=None, help="JSON with every summary, commands and versions")
    ap.add_argument("--log-dir", default="/tmp/deepserve-peer-routers")
    args = ap.parse_args(argv)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    vers = versions()
    print(f"versions: {vers}", file=sys.stderr)
    pin = Pinning(args.pin_router, args.pin_workers, args.pin_client)
    if pin.client:
        os.sched_setaffinity(0, _cpu_set(pin.client))
    print(f"pinning: {pin.describe()}", file=sys.stderr)
    results: list[Result] = []
    for name in args.scenarios:
        sc = SCENARIOS[name]
        if args.num_requests:
            sc = Scenario(**{**sc.__dict__, "num_requests": args.num_requests})
        if args.policies:
            sc = Scenario(**{**sc.__dict__, "policies": tuple(args.policies)})
        SCENARIOS[name] = sc
        runs = [(policy, router) for policy in sc.policies for router in args.routers if router != "direct" or policy == sc.policies[0]]
        for rnd in range(args.repeat):
            k = rnd % len(runs)  # each round starts one run later: no router always goes first
            for policy, router in runs[k:] + runs[:k]:
                try:
                    results.append(run_one(sc, router, policy, log_dir, lambda m: print(m, file=sys.stderr), pin, rnd))
                except Exception as exc:  # noqa: BLE001 (record and go on: one broken peer must not lose the run)
                    print(f"  {name} {router} {policy}: FAILED: {exc!r}", file=sys.stderr)
    table = markdown(results)
    rows = stats(results)
    if args.repeat > 1:
        table += "\n" + ranges(results) + "\nMedian [interquartile range] over the rounds; ratios per round:\n\n" + stats_markdown(rows)
    print(table)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        doc = {"versions": vers, "machine": machine_info(), "scenarios": {k: SCENARIOS[k].__dict__ for k in args.scenarios},
               "pinning": pin.__dict__, "results": [r.__dict__ for r in results], "stats": rows, "markdown": table}
        Path(args.output).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
