"""The slot decode seam: one interface (``SlotDecoder``), one state mechanism (``SlotPool``).

Every slot decoder of the project — the CUDA-graph + Triton step (``static_decode.StaticDecoder``),
the host CPU step (``host_decode.HostDecoder``), the expert-parallel rank (``parallel.ep.EPDecoder``)
and the V4.1 decoder (``model.v41``) — is used by ``engine.runtime`` through ``SlotDecoder`` only.
"""

from engine.model.slots.interface import SlotDecoder, VerifyingSlotDecoder
from engine.model.slots.pool import CompPool, LayerPool, SlotPool

__all__ = ["CompPool", "LayerPool", "SlotDecoder", "SlotPool", "VerifyingSlotDecoder"]
