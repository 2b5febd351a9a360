"""deepserve ``SamplingParams`` → the keyword arguments of DeepInfer's ``SamplingParams``.

DeepInfer 0.1.0's ``SamplingParams(temperature, top_p, top_k, ignore_eos, max_tokens, logprobs,
prompt_logprobs, top_logprobs, first_n_token_no_eos, eos_id, so_args, golden_token_ids,
seq_seed)`` has no min_p, no penalties, no stop_token_ids, no min_tokens and no logit_bias (its
``prompt_logprobs`` output is not read back here): a request that sets any of them is refused (``UnsupportedSampling``, a 400 naming them) rather
than served differently from what it asked. Mapped: ``seed`` → ``seq_seed`` (uint64; None lets
DeepInfer draw one), ``top_k`` 0 → -1 (its "off"), ``constraint`` → ``so_args`` (``schema_type``
regex / json / ebnf, the JSON schema as a string, ``trigger_token_ids``: DeepInfer takes one
trigger sequence, deepserve a set of single trigger tokens, so only one token maps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from deepserve.protocol import OutputConstraint, SamplingParams


class UnsupportedSampling(InvalidRequestError):
    """A sampling setting DeepInfer's SamplingParams cannot express; ``fields`` names them."""

    def __init__(self, fields: list[str]) -> None:
        self.fields = tuple(fields)
        super().__init__(f"the deepinfer backend does not support: {', '.join(fields)}")


@dataclass(frozen=True)
class DeepInferSampling:
    """Exactly the arguments given to ``deepinfer.sampling_params.SamplingParams``."""

    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    ignore_eos: bool
    top_logprobs: int
    seq_seed: int | None
    so_args: dict[str, Any] | None

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments (``logprobs`` is ignored by DeepInfer: token logprobs come always)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "ignore_eos": self.ignore_eos,
            "top_logprobs": self.top_logprobs,
            "seq_seed": self.seq_seed,
            "so_args": self.so_args,
        }


_DEFAULTS = SamplingParams()  # each field's "off" value; a request setting another is refused
_UNSUPPORTED = (
    "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop_token_ids", "min_tokens", "logit_bias",
    "prompt_logprobs",  # DeepInfer's own prompt_logprobs output is not read back by this backend
    "max_reasoning_tokens",
)
_SCHEMA_TYPES = {"json": "json", "regex": "regex", "ebnf": "ebnf"}


def unsupported_fields(sampling: SamplingParams) -> list[str]:
    """The set fields DeepInfer cannot honour (empty when it can serve the request as asked)."""
    bad = [name for name in _UNSUPPORTED if getattr(sampling, name) != getattr(_DEFAULTS, name)]
    c = sampling.constraint
    if c is not None:
        if c.kind not in _SCHEMA_TYPES:
            bad.append(f"constraint.kind={c.kind}")
        if len(c.trigger_token_ids) > 1:
            bad.append("constraint.trigger_token_ids (more than one)")
        if c.compact:
            bad.append("constraint.compact")
    return bad


def so_args(constraint: OutputConstraint) -> dict[str, Any]:
    """DeepInfer's ``so_args`` for a supported constraint (``""`` JSON spec = any JSON value)."""
    spec = "{}" if constraint.kind == "json" and not constraint.spec else constraint.spec
    args: dict[str, Any] = {"schema_type": _SCHEMA_TYPES[constraint.kind], "schema": spec}
    if constraint.trigger_token_ids:
        args["trigger_token_ids"] = [int(constraint.trigger_token_ids[0])]
    return args


def to_deepinfer(sampling: SamplingParams, max_tokens: int | None = None) -> DeepInferSampling:
    """Map, or raise ``UnsupportedSampling`` naming every setting that cannot be honoured.

    ``max_tokens``: the tokens still to generate when some were produced elsewhere (a decode
    stage after a prefill); default ``sampling.max_tokens``.
    """
    bad = unsupported_fields(sampling)
    if bad:
        raise UnsupportedSampling(bad)
    return DeepInferSampling(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else -1,
        max_tokens=sampling.max_tokens if max_tokens is None else max_tokens,
        ignore_eos=sampling.ignore_eos,
        top_logprobs=sampling.top_logprobs if sampling.logprobs else 0,
        seq_seed=None if sampling.seed is None else sampling.seed & 0xFFFF_FFFF_FFFF_FFFF,
        so_args=None if sampling.constraint is None else so_args(sampling.constraint),
    )
