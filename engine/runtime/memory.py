"""The sequence-state budget in bytes.

On CPU it is given (``EngineConfig.state_memory_bytes``). On a GPU it is measured, vLLM's way,
once everything else the engine keeps on the device is allocated — the weights, the static
decoder's slot pools and its CUDA graphs (every bucket captured), and the activations of one
profiled prefill of a full step's tokens, which the caching allocator keeps reserved for the
steps after it: ``gpu_memory_utilization × total − (total − free)``, from the driver's own
free/total figures (other processes' memory included, nothing estimated). ``StatePool`` then
accounts sequences against it by their real state bytes (``state_pool.state_bytes``).
"""

from __future__ import annotations

import torch

from engine.model.model import DeepseekV4ForCausalLM


def profile_prefill(model: DeepseekV4ForCausalLM, tokens: int) -> None:
    """One general-path prefill of ``tokens`` tokens on a throwaway state (its activation peak
    stays reserved by the caching allocator, the state is freed)."""
    with torch.inference_mode():
        model([(model.new_state(), [0] * tokens)])


def gpu_state_budget(device: torch.device, utilization: float) -> int:
    """Bytes left for sequence state under ``utilization`` of the device's memory, now."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return int(utilization * total) - (total - free)
