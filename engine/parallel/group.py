"""One engine rank's place in an expert-parallel group: what an ``EngineCore`` asks of the group.

An expert-parallel worker is ``R`` rank processes (one per GPU; gloo processes on CPU), each a
data-parallel rank with its own scheduler and sequences, the routed experts split over them
(``engine.parallel.ep``). Every MoE layer is a collective, so every rank must run the same
sequence of model calls in every engine step. A step has two phases, always in this order:

1. **slot decode** (``EPDecoder.step``, fixed capacity, CUDA graphs on GPU), run by every rank
   when any rank has a slotted decode sequence (0 slots on the others);
2. **general path** (prefill chunks, decode off the slots: ``model(chunks)``, whose MoE layers go
   through ``ep_routed_varlen``), run by every rank when any rank has such a chunk; a rank with
   none calls ``join_general``, which takes part in each layer's exchange with 0 rows.

``agree`` (a CPU all-reduce over the group's gloo twin) tells every rank which phases run. Which
step runs at all is the backend's agreement (``engine.backends.reference.ep_rank``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.model.model import DeepseekV4ForCausalLM
from engine.parallel.ep import EPDecoder, cpu_group_for, ep_routed_varlen, shard_experts


class ExpertGroup:
    """The process group of one expert-parallel rank, its experts' cut and the step agreements.
    Collective to build: every rank of ``group`` (default: the world) makes one."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.cpu_group = cpu_group_for(group)

    def attach(self, model: DeepseekV4ForCausalLM) -> None:
        """Keep this rank's share of the routed experts and send every MoE layer's routed experts
        through the group (``MoE.ep``)."""
        shard_experts(model, self.rank, self.world)
        for layer in model.model.layers:
            layer.mlp.ep = self._moe

    def _moe(self, moe, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        weights, indices = moe.gate(x, token_ids)
        return ep_routed_varlen(x, weights, indices, moe.experts, self.group) + moe.shared_experts(x)

    def decoder(self, model: DeepseekV4ForCausalLM, max_slots: int, max_tokens: int) -> EPDecoder:
        """The slot decoder of this rank (CUDA graphs on GPU, plain steps on CPU)."""
        return EPDecoder(model, max_slots, max_tokens, group=self.group, cpu_group=self.cpu_group, use_graphs=model.device.type == "cuda")

    def any(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag or-ed over the group (one small CPU all-reduce)."""
        t = torch.tensor([int(f) for f in flags], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return tuple(bool(v) for v in t.tolist())

    def join_general(self, model: DeepseekV4ForCausalLM) -> None:
        """Take part in a general-path forward with no tokens: each MoE layer's exchange, 0 rows
        sent, the peers' rows computed by this rank's experts and sent back."""
        cfg = model.config
        x = torch.empty(0, cfg.hidden_size, dtype=model.dtype, device=model.device)
        w = torch.empty(0, cfg.num_experts_per_tok, dtype=torch.float32, device=model.device)
        idx = torch.empty(0, cfg.num_experts_per_tok, dtype=torch.long, device=model.device)
        with torch.inference_mode():
            for layer in model.model.layers:
                ep_routed_varlen(x, w, idx, layer.mlp.experts, self.group)
