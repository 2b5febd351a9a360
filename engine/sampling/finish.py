"""The stop rule: whether a request ends with the token it just sampled, and why.

Checked in this order, after the token is appended (it counts toward ``max_tokens``):
1. a user stop token id                          -> "stop"
2. an EOS id, unless ``ignore_eos``              -> "stop"
3. the grammar accepted its final EOS            -> "stop" (even with ``ignore_eos``: a finished
   grammar allows no further token)
4. ``max_tokens`` output tokens reached          -> "length"
A token the grammar rejected ends the request with "error" (the mask should make it impossible).
The stop or EOS token itself is part of the sampled output; whoever detokenizes drops EOS.
"""

from __future__ import annotations

from collections.abc import Container

from deepserve.protocol import FinishReason, SamplingParams


def check_finish(
    params: SamplingParams,
    token_id: int,
    num_output_tokens: int,
    eos_token_ids: Container[int],
    *,
    grammar_terminated: bool = False,
    grammar_rejected: bool = False,
) -> FinishReason | None:
    """The finish reason after sampling ``token_id`` as output token number ``num_output_tokens``."""
    if grammar_rejected:
        return "error"
    if token_id in params.stop_token_ids:
        return "stop"
    if token_id in eos_token_ids and not params.ignore_eos:
        return "stop"
    if grammar_terminated:
        return "stop"
    if num_output_tokens >= params.max_tokens:
        return "length"
    return None
