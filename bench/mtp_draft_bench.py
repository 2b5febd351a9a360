"""Issue 25's slot speculative step on the V4-Flash-width slice: the MTP draft step
(``engine.model.slots.mtp_draft.SlotDrafter``) beside the verify step and the plain decode step.

    python -m bench.mtp_draft_bench --output FILE.json [--ks 1,2,3] [--batches 1,4,16] [--context 1024]
    python -m bench.mtp_draft_bench --small --output FILE.json     # a CPU smoke run of this script

The model is ``bench.gpu_slice_bench.random_slice`` (4 layers at the release's width, random bf16
weights) plus an MTP layer at the same width drawn the same way. One ``context``-token sequence is
prefilled on the general path and loaded into every slot; the MTP windows are full (``W - 1``
random keys). Per batch ``b``: the plain ``StaticDecoder.step`` (host-inclusive and bare CUDA-graph
replay), and per ``k``: ``verify`` of ``1 + k`` tokens per slot + ``accept`` (every draft kept),
the draft step (``SlotDrafter.draft``: feed ``1 + k`` columns, chain ``k`` drafts) host-inclusive
and as a bare replay, and their sum, the whole slot speculative step minus sampling, against
``1 + k`` plain steps (the most tokens that step can give). Milliseconds, CUDA events for replays.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.gpu_slice_bench import _sync_time, random_slice, time_static
from bench.kernel_helpers import replay_ms


def random_mtp(model, device: str):
    """An ``MTPLayer`` at ``model``'s shape, weights drawn as ``random_slice`` draws them."""
    from engine.model.mtp import MTPLayer

    with torch.inference_mode(False), torch.device(device):
        layer = MTPLayer(model.config, model.dtype).eval()
    g = torch.Generator(device=device).manual_seed(3)
    with torch.inference_mode(False), torch.no_grad():
        for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
            if not t.is_floating_point():
                continue
            if t.dim() == 1:
                t.fill_(1.0 if name.endswith(("norm.weight", "scale")) else 0.0)
            else:
                t.normal_(0.0, t.shape[-1] ** -0.5, generator=g)
    return layer


def rows_for(model, layer, ks: list[int], batches: list[int], context: int, iters: int) -> list[dict]:
    from engine.model.mtp import DraftState
    from engine.model.slots.mtp_draft import SlotDrafter
    from engine.model.state import LayerState
    from engine.model.static_decode import StaticDecoder, bucket_for

    gen = torch.Generator().manual_seed(1)
    cfg, dev = model.config, model.device
    prompt = torch.randint(2, cfg.vocab_size, (context,), generator=gen).tolist()
    base = model.new_state()
    for a in range(0, context, 8192):
        model([(base, prompt[a : a + 8192])])
    room = context + (iters + 4) * (max(ks) + 1) * 4 + 8
    slots_n = max(batches)
    plain = StaticDecoder(model, max_slots=slots_n, max_tokens=room)
    out = []
    for batch in batches:
        slots = list(range(batch))
        nxt = torch.randint(2, cfg.vocab_size, (batch,), generator=gen).tolist()
        t_step, t_replay = time_static(plain, batch, base, nxt, iters)
        row = {"batch": batch, "context": context, "plain_step_ms": 1e3 * t_step, "plain_replay_ms": 1e3 * t_replay}
        for k in ks:
            dec = StaticDecoder(model, max_slots=slots_n, max_tokens=room, verify_width=k + 1)
            drafter = SlotDrafter(model, layer, slots_n, k, dec.buckets, dec.use_graphs)
            window = torch.randn(layer.block.self_attn.window - 1, cfg.head_dim, generator=gen).to(dev, model.dtype)
            for i in slots:
                dec.load(i, base)
                drafter.pool.load(i, DraftState(LayerState(swa=window), context))
            rows = [[t, *torch.randint(2, cfg.vocab_size, (k,), generator=gen).tolist()] for t in nxt]
            streams = torch.randn(batch, k + 1, cfg.hc_mult, cfg.hidden_size, generator=gen).to(dev, model.dtype)
            next_ids = [r[1:] + [5] for r in rows]  # every draft kept: k + 1 fed columns

            def verify(dec=dec, rows=rows, k=k) -> None:
                dec.verify(slots, rows)
                dec.accept([k + 1] * batch)

            def draft(drafter=drafter, streams=streams, next_ids=next_ids) -> None:
                drafter.draft(slots, streams, next_ids)

            t_verify = _sync_time(verify, 2, iters)
            t_draft = _sync_time(draft, 2, iters)
            t_spec = _sync_time(lambda verify=verify, draft=draft: (verify(), draft()), 2, iters)
            b = bucket_for(batch, dec.buckets)
            v_replay = replay_ms(dec._graphs[b, k + 1][0], iters) if dec.use_graphs else float("nan")
            d_replay = replay_ms(drafter._graphs[b][0], iters) if drafter.use_graphs else float("nan")
            row[f"k{k}"] = {
                "verify_step_ms": 1e3 * t_verify, "verify_replay_ms": v_replay, "draft_step_ms": 1e3 * t_draft,
                "draft_replay_ms": d_replay, "spec_step_ms": 1e3 * t_spec, "spec_vs_plain": t_spec / t_step,
                "spec_ms_per_token_at_full_acceptance": 1e3 * t_spec / (k + 1),
            }  # fmt: skip
            print(
                f"b={batch} k={k}: plain {1e3 * t_step:.3f} ms (replay {1e3 * t_replay:.3f}); verify {1e3 * t_verify:.3f} ms "
                f"(replay {v_replay:.3f}); draft {1e3 * t_draft:.3f} ms (replay {d_replay:.3f}); verify+draft {1e3 * t_spec:.3f} ms "
                f"= {t_spec / t_step:.2f}x plain, {1e3 * t_spec / (k + 1):.3f} ms/token at full acceptance",
                flush=True,
            )  # fmt: skip
            del dec, drafter
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", required=True)
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="a narrow config (a smoke test of this script, CPU too)")
    args = ap.parse_args()
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model = random_slice("v4-flash-narrow" if args.small else "v4-flash", device, torch.bfloat16 if cuda else torch.float32)
    layer = random_mtp(model, device)
    rows = rows_for(model, layer, [int(k) for k in args.ks.split(",")], [int(b) for b in args.batches.split(",")], args.context, args.iters)
    with open(args.output, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if cuda else "cpu", "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
