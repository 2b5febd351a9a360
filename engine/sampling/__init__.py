"""Sampling and structured output for the engine.

Module map:
- ``sampler.py``: ``Sampler.sample(logits or LogitSource, states)``, the one call per engine step;
- ``state.py``: ``SamplingState`` (per request) and the per-request (seed, step) random stream;
- ``penalties.py``, ``distribution.py``: the batched logit transforms and the draw;
- ``finish.py``: the stop rule;
- ``structured.py``: xgrammar grammars, their cache and per-request ``GrammarState``;
- ``compile_pool.py``: the compiles, in child processes with a deadline (off the engine thread);
- ``dsml.py``: DeepSeek V4 / V4.1 tool-call (DSML) grammars.

Engine wiring, once per worker::

    grammars = GrammarCompilerCache.from_tokenizer_json(ckpt / "tokenizer.json", vocab_size, eos_ids)
    sampler = Sampler(SamplerConfig(vocab_size, eos_ids), grammars)

per request ``state = sampler.new_state(params, prompt_ids, output_ids)``, per step
``out = sampler.sample(logits, [state of each row])``.
"""

from engine.sampling.errors import InvalidConstraintError
from engine.sampling.finish import check_finish
from engine.sampling.sampler import (
    LogitSource,
    LogprobsMode,
    SampleOutput,
    Sampler,
    SamplerConfig,
)
from engine.sampling.state import SamplingState, request_uniform
from engine.sampling.structured import (
    GrammarCompilerCache,
    GrammarState,
    load_tokenizer_info,
)

__all__ = [
    "GrammarCompilerCache",
    "GrammarState",
    "InvalidConstraintError",
    "LogitSource",
    "LogprobsMode",
    "SampleOutput",
    "Sampler",
    "SamplerConfig",
    "SamplingState",
    "check_finish",
    "load_tokenizer_info",
    "request_uniform",
]
