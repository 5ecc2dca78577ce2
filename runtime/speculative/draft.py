"""Draft-model proposer: a smaller artifact with the same vocabulary guesses the next K tokens.

The draft keeps its own KV cache (``runtime.seq_cache``: in place on a shared-layout draft,
concat otherwise) and the token list that cache describes. On every ``propose`` it finds the
longest common prefix between that list and the new context (the verifier may have rejected
some of its drafts), keeps that much of its cache (a length move on the shared layout), feeds
the rest of the context in one run and then drafts K tokens one run each. A self-draft (``specport export
MODEL --layers N``: the first N layers of the target) is the cheapest way to get one.

A draft whose KV has the target's shapes (the target quantized: ``specport quantize TARGET
--scheme w4a8``) runs in the target's own cache row instead (``share_target_kv``): the
positions the target has cached are its context, so it never reads the prompt (on a long
prompt that prefill cost more than the drafts saved), holds no KV of its own, and drafts from
the target's keys and values, not its own approximations of them. It writes its drafts' keys
and values past the target's cached length, where the target's verify run then writes its
own: the target only ever reads positions it wrote, so its tokens do not change.

Greedy decoding drafts the argmax and carries no probabilities; when sampling, each draft is
drawn from the draft's processed distribution q (same settings as the target's sampler) and q
travels in ``Drafts.probs`` so rejection sampling stays lossless.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from specport.artifact.manifest import Manifest
from specport.core.errors import InputError
from specport.runtime.kv.seq_cache import RowCache, open_cache
from specport.runtime.sampler import Sampler, SamplingConfig, sample_from_probs
from specport.runtime.speculative.base import Drafts, ProposerBase

logger = logging.getLogger(__name__)

# tokens a draft model reads between steps that draft with it (the bonus + 1): a propose that
# read more first ran a prefill (a prompt, or text it skipped), which is no draft's price
CATCH_UP = 2


class DraftModelProposer(ProposerBase):
    """Proposes with a draft artifact's session; batch 1 (one context row)."""

    name = "draft"
    adaptive_default = True  # lifts a poor draft model from 0.46x to 0.87x (README)

    def __init__(
        self, session: Any, manifest: Manifest, target_vocab_size: int | None = None
    ) -> None:
        if target_vocab_size is not None and manifest.vocab_size != target_vocab_size:
            raise InputError(
                f"the draft model's vocabulary has {manifest.vocab_size} tokens but the target's has "
                f"{target_vocab_size}; a draft must share the target's tokenizer. Export a draft from "
                "the same model family (e.g. `specport export MODEL --layers 2 --out DRAFT`)."
            )
        self.session = session
        self.manifest = manifest
        self._bound: Any = None  # the shared layout's bound buffers, kept across resets
        self._target: tuple[Any, int] | None = None  # (target KV cache, row) it drafts in
        self._verdict: tuple[Any, bool] | None = None  # (target manifest, first_layers_of)
        self.sampler: Sampler | None = None
        self.rng = np.random.default_rng()
        self.reset()

    def configure(self, sampling: SamplingConfig | None) -> None:
        """Greedy drafts (None or greedy config) or sampled drafts with probabilities."""
        if sampling is None or sampling.greedy:
            self.sampler = None
        else:
            self.sampler = Sampler(sampling, self.manifest.vocab_size)
            seed = None if sampling.seed is None else sampling.seed + 7919
            self.rng = np.random.default_rng(seed)

    def start(
        self, sampling: SamplingConfig | None, stream: int | None = None, budget: int | None = None
    ) -> None:
        """A new request: sampled drafts for a sampling config (rows of a batch, ``stream``,
        draw from independent, still seeded, streams), and an empty draft cache."""
        self.configure(sampling)
        if stream is not None and sampling is not None and sampling.seed is not None:
            self.rng = np.random.default_rng([sampling.seed, 7919, stream])
        self.reset()

    def draft_cost(self, target: Any) -> float:
        """One draft-model run per draft: its share of a target step, by layer count times the
        bits each stores per weight (a decode step reads every weight once). A prior: timed
        draft runs replace it under greedy decoding. The target quantized to 4 bits drafts
        for its float self at about a quarter of the bytes (SmolLM2: 8.5 of 32 bits per
        weight; measured 0.35-0.45 of an fp32 step on AVX2, the int8 kernels being
        compute-bound there)."""
        mine, theirs = num_layers(self.manifest), num_layers(target)
        if not mine or not theirs:
            return 0.0
        return (
            float(mine) / float(theirs) * _bits_per_weight(self.manifest) / _bits_per_weight(target)
        )

    def reset(self) -> None:
        self.cache: RowCache | None = None  # opened at the first propose without a target's
        if self._bound is not None:
            self.cache = open_cache(self.session, self.manifest, bound=self._bound)
        self._target = None
        self.tokens: list[int] = []  # the tokens whose keys/values ``cache`` holds
        self.caught_up = 0  # tokens of context the last propose fed before drafting

    def share_target_kv(self, cache: Any, row: int) -> bool:
        """Draft in row ``row`` of the target's shared-layout ``cache`` when this draft's
        layers are the target's first ones (``first_layers_of``) with its KV shapes and
        dtypes (module docstring); otherwise keep its own cache."""
        from specport.core.errors import ArtifactError, ContextLengthError
        from specport.runtime.kv.cache import SharedKVCache

        if self._target is not None and self._target[0] is cache and self._target[1] == row:
            return True  # a server asks every step: its rows may have moved
        buffers = getattr(cache, "buffers", None)
        target = getattr(cache, "manifest", None)
        if self._verdict is None or self._verdict[0] is not target:  # once per target
            self._verdict = (target, first_layers_of(target, self.manifest))
        if buffers is None or not self._verdict[1]:
            return False
        views = [b[row : row + 1] for b in buffers]
        try:
            kv = SharedKVCache(self.session, self.manifest, 1, cache.max_length, buffers=views)
        except (ArtifactError, ContextLengthError) as exc:
            logger.debug("the draft keeps its own KV: %s", exc)
            return False
        self.cache = RowCache(kv, cache.max_length)
        self.tokens = []
        self._target = (cache, row)
        return True

    def behind(self, row: list[int]) -> int:
        """Tokens of ``row`` the draft would read before its first draft: all it has not read
        yet, a prompt included (a prefill that a short answer may not repay)."""
        return len(row) - self._kept(row)

    def _kept(self, row: list[int]) -> int:
        """Positions of its cache that still hold ``row``'s tokens: their common prefix, less
        the last token, which must be fed again to get logits (in the target's cache: the
        positions the target holds, which are ``row``'s)."""
        if self._target is not None:
            cache, r = self._target
            return min(int(cache.lengths[r]), len(row) - 1)
        n = min(len(self.tokens), len(row))
        if self.tokens[:n] == row[:n]:  # the usual case: one list comparison
            common = n
        else:
            common = next(i for i, (a, b) in enumerate(zip(self.tokens, row)) if a != b)
        return min(common, len(row) - 1)

    def propose(self, context: list[list[int]], num_draft: int) -> Drafts:
        if len(context) != 1:
            raise InputError(f"the draft-model proposer runs batch 1, got {len(context)} rows")
        from specport.runtime.kv.seq_cache import context_limit

        row = [int(t) for t in context[0]]
        limit = context_limit(self.manifest)
        if self._target is not None:  # the target's buffer: its drafts go past its length
            limit = min(limit, int(self._target[0].max_length))
        room = limit - len(row)
        k = min(int(num_draft), room)
        if k <= 0 or not row:
            return Drafts.empty(1)
        if self.cache is None:  # its own cache, its buffers kept for the next requests
            self.cache = open_cache(self.session, self.manifest, bound=self._bound)
            self._bound = self.cache.bound
        common = self._kept(row)
        if self._target is not None:
            self.cache.assume(common)
            self.tokens = row[:common]
        else:
            self.cache.keep(common)
            self.tokens = self.tokens[:common]
        feed = row[common:]
        self.caught_up = len(feed)  # the context its first run fed (a prompt: a prefill)
        drafts: list[int] = []
        probs: list[np.ndarray] = []
        for i in range(k):
            logits = self.cache.step(feed, last_only=True).logits  # [1, V]
            self.tokens += feed
            if self.sampler is None:
                tok = int(np.argmax(logits[0]))
            else:
                q = self.sampler.probs(logits, [np.asarray(self.tokens, dtype=np.int64)])  # [1, V]
                tok = int(sample_from_probs(q, self.rng)[0])
                probs.append(q[0])
            drafts.append(tok)
            feed = [tok]
            if i + 1 < k and len(self.tokens) + 1 >= limit:
                break
        q_arr = np.stack(probs)[None] if probs else None  # [1, K, V]
        return Drafts.from_lists([drafts], q_arr)


def source_of(manifest: Any) -> tuple[Any, ...]:
    """What an artifact was exported from: its source path, the config's hash and the GGUF's
    hash when there is one (quantize keeps the source record)."""
    src = getattr(manifest, "source", None) or {}
    return (src.get("config_sha256"), src.get("path"), (src.get("gguf") or {}).get("sha256"))


def first_layers_of(target: Any, draft: Any) -> bool:
    """Whether ``draft``'s layers are ``target``'s first ones, so the keys and values the
    target caches are what the draft's own layers would compute (up to its quantization):
    both exported from the same source, the draft with at most as many layers (quantized,
    or cut with ``export --layers N``), both on the shared KV layout, both caching the source
    model's float values (`cached_values`)."""
    if target is None or draft is None or not source_of(target)[0]:
        return False
    mine, theirs = num_layers(draft), num_layers(target)
    return (
        source_of(draft) == source_of(target)
        and mine is not None
        and theirs is not None
        and mine <= theirs
        and draft.kv.layout == target.kv.layout == "shared"
        and draft.kv.dtype == target.kv.dtype
        and cached_values(draft) == cached_values(target) == "source"
    )


def cached_values(manifest: Any) -> str:
    """What an artifact's KV cache holds: "source" (the float model's keys and values, in
    float), "smoothed" (W8A8 with SmoothQuant scales folded into the value projection: the
    values divided by them; `quantize --keep-kv-values` avoids it) or "int8" (a quantized
    cache, with its own scales). Only "source" caches can be shared between two artifacts.
    W8A8 files made before the manifest said count as smoothed."""
    kv = getattr(manifest, "kv", None)
    dtypes = {getattr(kv, "dtype", "float32"), *(getattr(kv, "layer_dtypes", None) or [])}
    if dtypes - {"float32", "float16", "bfloat16"}:
        return "int8"
    quant = getattr(manifest, "quant", None) or {}
    default = "smoothed" if quant.get("scheme") == "w8a8" else "source"
    return str(quant.get("kv_values", default))


def num_layers(manifest: Any) -> int | None:
    """The decoder layers an artifact runs (its config's ``num_layers``), None when unknown."""
    n = (getattr(manifest, "config", None) or {}).get("num_layers")
    return n if isinstance(n, int) else None


def _bits_per_weight(manifest: Any) -> float:
    """Bits a weight takes in an artifact: quantize's recorded size, else its float width."""
    size = ((getattr(manifest, "quant", None) or {}).get("size") or {}).get("bits_per_weight")
    if isinstance(size, (int, float)) and size > 0:
        return float(size)
    dtype = str(getattr(manifest, "dtype", None) or "float32")
    return 16.0 if dtype in ("float16", "bfloat16") else 32.0
