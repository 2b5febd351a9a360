"""Structured output: xgrammar token masks for the constraint kinds deepseek-recipe emits.

One ``GrammarCompilerCache`` per tokenizer (per engine worker) turns an ``OutputConstraint`` into a
compiled grammar, cached by ``(kind, spec, compact)``; one ``GrammarState`` per request walks it.

Compilation runs in the cache's ``CompilePool`` (``compile_pool.py``: child processes, a compile
past ``compile_timeout_s`` killed), never on the engine thread: ``submit`` returns a future at once
and the engine admits the request once its future is done (``engine.runtime.engine_core``). A spec
longer than ``max_spec_bytes`` is refused before any work. Failed compiles (timeouts included) are
cached like successes, so the same hostile spec costs its compile time once.

Kinds (``deepserve.protocol.OutputConstraint``):
- ``json``: ``spec`` is a JSON schema (compact JSON), or ``""`` for free JSON: xgrammar's builtin
  grammar, an object or an array (what a ``json_object`` response format asks for). Schemas pass
  ``deepserve.protocol.json_schema``'s audit first (keywords xgrammar would not enforce are refused), so every
  output validates against the schema. ``compact``: no whitespace outside strings, ``,``/``:``
  separators.
- ``regex``: ``spec`` is the pattern (the whole output matches it).
- ``ebnf``: ``spec`` is an xgrammar EBNF grammar with a ``root`` rule.
- ``tool_call`` / ``tool_call_required`` / ``tool_call_forced``: ``spec`` is the Chat Completions
  tool list; the output is DSML tool-call markup (see ``engine.sampling.dsml``).

Vocabulary. The mask covers the *model's* vocabulary (``vocab_size``, the lm_head rows), which may
exceed the tokenizer's: ids past the tokenizer are never allowed. The tokenizer's added tokens
(chat markers, ``<think>``, FIM, placeholders, ...) are never allowed inside constrained output
either: a ``<｜User｜>`` token inside a JSON string would corrupt the next turn. Only the DSML
token is kept (the model writes tool calls with it), and the EOS ids, which end the grammar.
Tool-call grammars also mask every token that could spell the DSML marker's bar ``｜`` in plain
text (``dsml_only_bar``): deepseek-recipe parses markup from the DSML token, so a plain-text
``｜DSML｜`` would stay content. Their argument whitespace runs are capped like JSON's.

Trigger tokens. With ``trigger_token_ids`` (thinking mode: the ``</think>`` id) the grammar is
inactive, and the output unconstrained, until one of them is sampled; from the next token on the
grammar applies. Once the grammar is complete the mask allows only EOS, so the request ends with
EOS; ``is_terminated()`` turns true when that EOS is accepted.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch
import xgrammar as xgr

from deepserve.protocol import OutputConstraint
from engine.sampling.compile_pool import CompilePool, CompileSettings
from engine.sampling.dsml import DsmlVersion
from engine.sampling.errors import InvalidConstraintError

GrammarKey = tuple[str, str, bool]  # (kind, spec, compact)

DSML_TOKEN = "｜DSML｜"


def load_tokenizer_info(
    tokenizer_json: str | Path,
    vocab_size: int,
    eos_token_ids: Sequence[int],
    *,
    keep_added_tokens: Iterable[str] = (DSML_TOKEN,),
) -> xgr.TokenizerInfo:
    """xgrammar's view of a Hugging Face ``tokenizer.json``, padded to the model's vocabulary.

    Added tokens other than ``keep_added_tokens`` get an empty spelling, which xgrammar treats as
    never matchable; EOS ids stay usable as xgrammar's stop tokens. Built once per process for a
    file (path, mtime and size) and these arguments (~0.45 s for a DeepSeek vocabulary), and
    shared: xgrammar only reads it.
    """
    path = Path(tokenizer_json).resolve()
    st = path.stat()
    return _tokenizer_info(path, st.st_mtime_ns, st.st_size, vocab_size, tuple(eos_token_ids), tuple(keep_added_tokens))


@functools.lru_cache(maxsize=8)
def _tokenizer_info(
    path: Path, _mtime_ns: int, _size: int, vocab_size: int, eos_token_ids: tuple[int, ...], keep_added_tokens: tuple[str, ...]
) -> xgr.TokenizerInfo:
    """``load_tokenizer_info``'s build (the file's mtime and size are part of the cache key)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    raw_vocab = data["model"]["vocab"]  # BPE / WordPiece: {piece: id}; Unigram: [[piece, score], ...]
    vocab: dict[str, int] = (
        dict(raw_vocab) if isinstance(raw_vocab, dict) else {p[0]: i for i, p in enumerate(raw_vocab)}
    )
    added = {int(t["id"]): t["content"] for t in data.get("added_tokens", [])}
    keep = set(keep_added_tokens)
    if not eos_token_ids or not all(0 <= e < vocab_size for e in eos_token_ids):
        raise ValueError(f"EOS ids {list(eos_token_ids)} must be non-empty and inside the vocabulary")
    encoded: list[str] = [""] * vocab_size  # ids past the tokenizer (lm_head padding) stay empty
    for tok, i in vocab.items():
        if i < vocab_size:
            encoded[i] = tok
    for i, content in added.items():
        if i < vocab_size:
            encoded[i] = content if content in keep else ""
    vocab_type, prefix_space = _vocab_type(data)
    return xgr.TokenizerInfo(
        encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids), add_prefix_space=prefix_space
    )


def _vocab_type(data: dict) -> tuple[xgr.VocabType, bool]:
    """(vocab type, add_prefix_space) from a tokenizer.json's decoder."""
    dec = json.dumps(data.get("decoder") or {})
    if '"ByteLevel"' in dec:
        return xgr.VocabType.BYTE_LEVEL, False
    if '"ByteFallback"' in dec:
        return xgr.VocabType.BYTE_FALLBACK, '"Metaspace"' in json.dumps(data.get("pre_tokenizer") or {})
    return xgr.VocabType.RAW, False


class GrammarState:
    """One request's walk through its grammar (not thread-safe; the engine loop owns it)."""

    def __init__(
        self, compiled: xgr.CompiledGrammar, trigger_token_ids: Sequence[int] = (), allowed: torch.Tensor | None = None
    ) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self.trigger_token_ids = frozenset(trigger_token_ids)
        self.active = not self.trigger_token_ids
        self.allowed = allowed  # (ceil(V/32),) int32 bits ANDed into every mask, or None

    def fill_mask(self, bitmask: torch.Tensor, row: int = 0) -> bool:
        """Write the allowed-token bits into ``bitmask[row]`` (int32, (B, ceil(V/32))).

        Returns False, writing nothing, while the grammar is inactive (before a trigger token).
        """
        if not self.active:
            return False
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self.allowed is not None:
            bitmask[row].bitwise_and_(self.allowed)
        return True

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it."""
        if not self.active:
            if token_id in self.trigger_token_ids:
                self.active = True
            return True
        return self._matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        """True once the grammar is complete and has accepted its EOS."""
        return self.active and self._matcher.is_terminated()


class GrammarCompilerCache:
    """Compiles ``OutputConstraint``s for one tokenizer on a ``CompilePool`` and caches them by
    ``(kind, spec, compact)``.

    Thread-safe: ``submit`` / ``compile`` may be called from any thread; a grammar is compiled at
    most once per key (a second request for it shares the first one's future).
    ``json_max_whitespace`` caps runs of whitespace between JSON tokens (models under a grammar
    sometimes emit whitespace forever; 16 characters still allow indented output); None means
    unbounded. An empty ``json`` spec (any JSON object or array) uses the same cap.
    ``compile_processes`` child processes compile, at ``compile_nice`` so a long compile yields the
    CPU to the engine thread, each compile killed after ``compile_timeout_s``; ``max_spec_bytes``:
    the longest spec compiled.
    """

    def __init__(
        self,
        tokenizer_info: xgr.TokenizerInfo,
        *,
        dsml_version: DsmlVersion = "v4",
        max_threads: int = 2,
        max_entries: int = 256,
        json_max_whitespace: int | None = 16,
        compile_processes: int = 1,
        compile_nice: int = 10,
        compile_timeout_s: float = 10.0,
        max_spec_bytes: int = 1 << 20,
    ) -> None:
        self.tokenizer_info = tokenizer_info
        self.vocab_size = tokenizer_info.vocab_size
        self.dsml_version = dsml_version
        self.json_max_whitespace = json_max_whitespace
        self.max_spec_bytes = max_spec_bytes
        settings = CompileSettings(dsml_version, json_max_whitespace, max_threads)
        self._pool = CompilePool(
            tokenizer_info, settings, processes=compile_processes, timeout_s=compile_timeout_s, nice=compile_nice
        )
        self._cache: OrderedDict[GrammarKey, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._max_entries = max_entries
        self._lock = threading.Lock()
        self._dsml_allowed: torch.Tensor | None = None

    @classmethod
    def from_tokenizer_json(
        cls, tokenizer_json: str | Path, vocab_size: int, eos_token_ids: Sequence[int], **kw
    ) -> GrammarCompilerCache:
        """Build from a checkpoint's ``tokenizer.json`` and the model's vocab size and EOS ids."""
        keep = kw.pop("keep_added_tokens", (DSML_TOKEN,))
        return cls(load_tokenizer_info(tokenizer_json, vocab_size, eos_token_ids, keep_added_tokens=keep), **kw)

    def submit(self, constraint: OutputConstraint) -> Future[xgr.CompiledGrammar]:
        """The future of a constraint's compiled grammar: cached, in flight, or started now on the
        pool. It fails with ``InvalidConstraintError`` for a constraint that cannot compile."""
        key = (constraint.kind, constraint.spec, constraint.compact)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            if len(constraint.spec.encode()) > self.max_spec_bytes:
                fut: Future[xgr.CompiledGrammar] = Future()
                fut.set_exception(InvalidConstraintError(f"the {constraint.kind} constraint is longer than {self.max_spec_bytes} bytes"))
                return fut
            fut = self._pool.submit(key)
            self._cache[key] = fut
            if len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)  # a running compile goes on for its holders
            return fut

    def compile(self, constraint: OutputConstraint) -> xgr.CompiledGrammar:
        """The compiled grammar of a constraint, waiting for it (raises ``InvalidConstraintError``)."""
        return self.submit(constraint).result()

    def new_state(self, constraint: OutputConstraint) -> GrammarState:
        allowed = self.dsml_only_bar() if constraint.kind.startswith("tool_call") else None
        return GrammarState(self.compile(constraint), constraint.trigger_token_ids, allowed)

    def dsml_only_bar(self) -> torch.Tensor:
        """Token bits for DSML output: every token except those that could spell the fullwidth
        bar ``｜`` (U+FF5C) of the DSML marker in plain text — tokens containing its UTF-8 bytes
        or ending in an unfinished prefix of them — with the DSML token itself kept. Under this
        mask the markup's ``｜DSML｜`` can only be the DSML token, the form deepseek-recipe's
        stream processor parses as markup (a plain-text spelling decodes to the same characters
        but stays content)."""
        with self._lock:
            if self._dsml_allowed is None:
                bar = "｜".encode()
                dsml = DSML_TOKEN.encode()
                banned = [
                    i
                    for i, b in enumerate(self.tokenizer_info.decoded_vocab)
                    if b != dsml and (bar in b or b.endswith((bar[:1], bar[:2])))
                ]
                mask = allocate_bitmask(1, self.vocab_size)[0]
                for i in banned:
                    mask[i // 32] &= ~(1 << (i % 32))
                self._dsml_allowed = mask
            return self._dsml_allowed


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask, (B, ceil(V/32)) int32."""
    return xgr.allocate_token_bitmask(batch_size, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the disallowed logits of ``rows`` to -inf in place, in one batched call."""
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)


# Most grammar positions allow few tokens. The sampler gathers such rows down to their allowed ids
# and samples over those alone, instead of masking and scanning the whole vocabulary.


def allowed_counts(bitmask: torch.Tensor) -> torch.Tensor:
    """Number of allowed tokens per row of a (G, W) int32 bitmask -> (G,) int64 (SWAR popcount)."""
    x = bitmask.long() & 0xFFFFFFFF  # (G, W) the 32 bits, unsigned
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    x = ((x * 0x01010101) & 0xFFFFFFFF) >> 24  # (G, W) bits per word
    return x.sum(-1)


def allowed_ids(bitmask: torch.Tensor, vocab_size: int, width: int) -> torch.Tensor:
    """The allowed token ids of each row of a (G, W) int32 bitmask, ascending, padded with -1
    to ``width`` columns -> (G, width) int64. Costs O(W + allowed), not O(V)."""
    rows, words = bitmask.nonzero(as_tuple=True)  # (K,) each: the nonzero 32-bit words
    bits = (bitmask[rows, words].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1  # (K, 32)
    hit = bits.bool()
    ids = (words.unsqueeze(1) * 32 + torch.arange(32))[hit]  # (N,) row-major, so ascending per row
    row_of = rows.unsqueeze(1).expand(-1, 32)[hit]  # (N,)
    keep = ids < vocab_size
    ids, row_of = ids[keep], row_of[keep]
    out = torch.full((bitmask.shape[0], width), -1, dtype=torch.int64)
    if ids.numel():
        starts = torch.searchsorted(row_of, torch.arange(bitmask.shape[0]))  # (G,) first entry of each row
        out[row_of, torch.arange(ids.numel()) - starts[row_of]] = ids
    return out
