"""``MTPPool``: the MTP layer's per-sequence sliding window (``mtp.DraftState``) in fixed slot
tensors, for the slot draft step (``slots.mtp_draft.SlotDrafter``).

Layout: ``ring (S+1, W, D)``, slot ``S`` scratch (padded columns write there). A window need not
start at position 0 (after a KV-store hit the MTP layer is fed from the first uncached token on),
so each slot keeps ``start``, the position of the first entry it was ever fed, and entry ``p``
sits at ring row ``(p - start) % W``: the window of an entry at ``p`` is then the first
``min(p - start + 1, W)`` rows once the ring has wrapped or not — the layout ``kernels.
decode_attention`` and ``cpu_slots.gather_attend`` read (with ``p - start`` as the position). The
host keeps ``start`` and ``next_pos`` (the position of the slot's next entry) per slot.
"""

from __future__ import annotations

import torch

from engine.model.mtp import DraftState, MTPLayer


class MTPPool:
    """``max_slots`` MTP windows (module docstring) in the layer's device and dtype."""

    def __init__(self, layer: MTPLayer, max_slots: int) -> None:
        attn = layer.block.self_attn
        self.layer, self.window, self.max_slots, self.scratch = layer, attn.window, max_slots, max_slots
        dev = layer.e_proj.weight.device
        with torch.inference_mode():
            self.ring = torch.zeros(max_slots + 1, self.window, attn.head_dim, dtype=layer.dtype, device=dev)  # (S+1, W, D)
        self.start = [0] * (max_slots + 1)
        self.next_pos = [0] * (max_slots + 1)

    def nbytes(self) -> int:
        """Bytes of the ring."""
        return self.ring.numel() * self.ring.element_size()

    @torch.inference_mode()
    def load(self, slot: int, state: DraftState) -> None:
        """Copy ``state``'s window into ``slot`` and mark ``state`` as living there."""
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} outside [0, {self.max_slots})")
        swa = state.window.swa  # (m, D): the entries at next_pos - m .. next_pos - 1
        m = swa.shape[0]
        assert m < self.window, "a general-path MTP window keeps at most W - 1 entries"
        if m:
            self.ring[slot, :m] = swa.to(self.ring.dtype)
        self.start[slot], self.next_pos[slot] = state.next_pos - m, state.next_pos
        state.slot = slot

    @torch.inference_mode()
    def export(self, slot: int, state: DraftState) -> None:
        """Write ``slot``'s window back into ``state`` (the general path's layout: the last
        ``W - 1`` entries in order) and mark it as no longer in a slot."""
        n = self.next_pos[slot] - self.start[slot]  # entries fed
        m = min(n, self.window - 1)
        at = torch.arange(n - m, n, device=self.ring.device) % self.window
        state.window.swa = self.ring[slot, at].clone()
        state.next_pos, state.slot = self.next_pos[slot], None
