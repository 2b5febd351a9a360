"""deepserve SamplingParams → DeepInfer's SamplingParams (engine/backends/deepinfer/sampling.py)."""

from __future__ import annotations

import pytest

from deepserve.protocol import OutputConstraint, SamplingParams
from engine.backends.deepinfer.sampling import UnsupportedSampling, to_deepinfer
from engine.errors import InvalidRequestError
from tests.engine.backends import deepinfer_standin as si


def test_the_supported_settings_map_one_to_one() -> None:
    got = to_deepinfer(SamplingParams(max_tokens=7, temperature=0.6, top_p=0.9, top_k=20, seed=-1, ignore_eos=True, logprobs=True, top_logprobs=3))
    assert got.kwargs() == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "max_tokens": 7,
        "ignore_eos": True,
        "top_logprobs": 3,
        "seq_seed": 2**64 - 1,  # DeepInfer's seq_seed is a uint64
        "so_args": None,
    }
    si.SamplingParams(**got.kwargs())  # the stand-in has DeepInfer's constructor


def test_off_values_become_deepinfers() -> None:
    got = to_deepinfer(SamplingParams(top_k=0, seed=None, top_logprobs=5, logprobs=False), max_tokens=3)
    assert (got.top_k, got.seq_seed, got.top_logprobs, got.max_tokens) == (-1, None, 0, 3)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("min_p", 0.1),
        ("presence_penalty", 0.5),
        ("frequency_penalty", -0.5),
        ("repetition_penalty", 1.1),
        ("stop_token_ids", (7,)),
        ("min_tokens", 2),
        ("logit_bias", ((5, 1.0),)),
    ],
)
def test_what_deepinfer_lacks_is_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(UnsupportedSampling) as err:
        to_deepinfer(SamplingParams(max_tokens=4, **{field: value}))
    assert isinstance(err.value, InvalidRequestError) and field in str(err.value) and err.value.fields == (field,)


def test_every_unsupported_field_is_named_at_once() -> None:
    with pytest.raises(UnsupportedSampling) as err:
        to_deepinfer(SamplingParams(min_p=0.2, repetition_penalty=1.3))
    assert err.value.fields == ("min_p", "repetition_penalty")


def test_constraints_become_so_args() -> None:
    schema = '{"type":"object","properties":{"a":{"type":"integer"}}}'
    assert to_deepinfer(SamplingParams(constraint=OutputConstraint("json", schema))).so_args == {"schema_type": "json", "schema": schema}
    assert to_deepinfer(SamplingParams(constraint=OutputConstraint("json"))).so_args == {"schema_type": "json", "schema": "{}"}
    got = to_deepinfer(SamplingParams(constraint=OutputConstraint("regex", "[a-z]+", trigger_token_ids=(128822,)))).so_args
    assert got == {"schema_type": "regex", "schema": "[a-z]+", "trigger_token_ids": [128822]}
    assert to_deepinfer(SamplingParams(constraint=OutputConstraint("ebnf", 'root ::= "x"'))).so_args["schema_type"] == "ebnf"


@pytest.mark.parametrize(
    ("constraint", "named"),
    [
        (OutputConstraint("tool_call", "[]"), "constraint.kind=tool_call"),
        (OutputConstraint("regex", "a", trigger_token_ids=(1, 2)), "constraint.trigger_token_ids (more than one)"),
        (OutputConstraint("json", "", compact=True), "constraint.compact"),
    ],
)
def test_constraints_deepinfer_cannot_express_are_refused(constraint: OutputConstraint, named: str) -> None:
    with pytest.raises(UnsupportedSampling) as err:
        to_deepinfer(SamplingParams(constraint=constraint))
    assert named in err.value.fields
