"""Batched speculative decoding on the concat KV layout: every live row drafts, one run verifies.

Each row keeps its cache left-padded and right-aligned in a shared [B, Hkv, W, D] tensor per
layer (W = the longest row's cached length; the cache holds a row's context minus its last
token, as in the batch-1 loop). A step feeds every live row S = 1 + K tokens: its last token,
its drafts, then filler tokens when it drafted fewer than the longest row. Fillers come after a
row's real tokens, so causal attention keeps them from touching real positions; their logits
and keys/values are simply dropped. ``attention_mask`` [B, W+S] is the row's padding mask plus
S ones and ``position_ids`` are explicit per row (fillers are clamped to the last position of
the context window, where they cannot index past a rotary table).

After verification row b keeps ``len_b + accepted_b + 1`` cached positions, which lie
contiguously in the presents at ``[W - len_b, W + accepted_b]``. The cache is rebuilt
left-padded to the new longest row (the common left padding disappears) with pad slots zeroed,
so a fully padded prefill row can never leak NaN keys into a later step. Rows that finish (EOS,
stop, budget) are removed from the batch and cost nothing afterwards.

Proposers are batch-1 objects (``make_proposer`` from the batch-1 loop), one per row: n-gram is
stateless, a draft model keeps one cache per row, and an MTP row reads its next drafts from its
own row of the graph's ``mtp_*`` outputs (the MTP branch is per row: argmax, gather and heads
all carry the batch axis). Under greedy decoding without a penalty an all-MTP batch trusts the
graph's own verification (``mtp_accepted`` / ``mtp_bonus``, no logits fetched), as the batch-1
fast path does; ``trust_graph = False`` makes the host verify. Greedy output equals plain
greedy decoding token for token per row (up to float ties); sampling uses lossless rejection
sampling per row with one seeded RNG.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specport.artifact import Manifest
from specport.contract import with_causal_tree_mask
from specport.runtime.sampler import Sampler, SamplingConfig
from specport.runtime.speculative.base import PAD, Drafts, Proposer, adopt, check_prompts
from specport.runtime.speculative.loop import check_num_draft, default_adaptive, make_proposer
from specport.runtime.speculative.metrics import (
    AdaptiveDraftLength,
    SpecDecodingStats,
    overhead_ms,
)
from specport.runtime.speculative.padded_kv import PaddedKV
from specport.runtime.speculative.verify import (
    VerifyResult,
    graph_verdict,
    greedy_rows,
    make_verifier,
)

logger = logging.getLogger(__name__)

__all__ = ["FILLER", "BatchSpeculativeGenerator", "PaddedKV", "generate_speculative_batch"]
_greedy_rows = greedy_rows  # the former private name

FILLER = 0  # token fed after a row's drafts when it drafted fewer than the longest row

# on_token(row, token_id) -> True to stop that row here (e.g. a stop string matched)
OnRowToken = Callable[[int, int], "bool | None"]


@dataclass
class BatchSpeculativeOutput:
    tokens: list[list[int]]  # new tokens per row (EOS included when it ended the row)
    finish_reasons: list[str]  # per row: "eos" | "length" | "stop" | "context"
    metrics: dict[str, Any] = field(default_factory=dict)
    stats: list[SpecDecodingStats] = field(default_factory=list)  # per row


class BatchSpeculativeGenerator:
    """Batched speculative generation; ``make_row_proposer()`` returns one batch-1 proposer."""

    def __init__(
        self,
        session: Any,
        manifest: Manifest,
        make_row_proposer: Callable[[], Proposer],
        num_draft: int,
        method: str = "custom",
        adaptive: bool = False,
    ) -> None:
        self.session = session
        self.adaptive = adaptive  # per-row draft length from recent acceptance
        self.manifest = manifest
        self.make_row_proposer = make_row_proposer
        self.num_draft = check_num_draft(num_draft)
        self.method = method
        self.output_names = [o.name for o in session.get_outputs()]
        self.n_kv = 2 * len(manifest.kv.inputs)
        mtp_outputs = (manifest.mtp or {}).get("outputs") or {}
        self._observed = [n for n in mtp_outputs.values() if n in self.output_names]
        kv_out = [n for pair in manifest.kv.outputs for n in pair]
        self._lean_fetch = [*kv_out, *self._observed]
        self.trust_graph = True  # greedy MTP: use the graph's own verification (no logits)
        self.record_kv = False  # tests: keep each row's final cache in ``row_kv``
        self.row_kv: dict[int, list[np.ndarray]] = {}

    def _check(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        m = self.manifest
        return check_prompts(prompts, max_new_tokens, m.context_length, m.vocab_size)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        eos_ids: Sequence[int] = (),
        on_token: OnRowToken | None = None,
    ) -> BatchSpeculativeOutput:
        rows = self._check(prompts, max_new_tokens)
        ctx_len, vocab = self.manifest.context_length, self.manifest.vocab_size
        n_rows = len(rows)
        sampling = sampling or SamplingConfig()
        sampler = Sampler(sampling, vocab)
        verifier = make_verifier(sampler)  # chosen once for the batch's settings
        proposers = [self._row_proposer(b, sampling) for b in range(n_rows)]
        controllers = [
            AdaptiveDraftLength(self.num_draft) if self.adaptive else None for _ in range(n_rows)
        ]
        budgets = [min(max_new_tokens, ctx_len - len(r)) for r in rows]
        eos = {int(e) for e in eos_ids}
        stats = [SpecDecodingStats() for _ in range(n_rows)]
        contexts = [list(r) for r in rows]
        out: list[list[int]] = [[] for _ in range(n_rows)]
        reasons = ["length"] * n_rows
        live = np.arange(n_rows)  # original row index of each batch slot
        kv = PaddedKV(self.manifest, n_rows)
        self.row_kv = {}
        ort_s = propose_s = 0.0
        batch_steps = 0

        trust = self._can_trust_graph(sampling, proposers)
        t_start = time.perf_counter()
        if max(len(r) for r in rows) > 1:  # prefill all but each row's last token
            ort_s += self._prefill(kv, rows)
        t_prefill = time.perf_counter()
        prefill_ort = ort_s
        t_first: float | None = None

        while live.size:
            t0 = time.perf_counter()
            drafts = self._propose(live, kv, proposers, controllers, contexts, out, budgets)
            propose_s += time.perf_counter() - t0
            s = drafts.width + 1
            ids = np.full((live.size, s), FILLER, dtype=np.int64)  # [n, S]
            ids[:, 0] = [contexts[b][-1] for b in live.tolist()]
            ids[:, 1:] = np.where(drafts.tokens == PAD, FILLER, drafts.tokens)
            positions = np.minimum(kv.lengths[:, None] + np.arange(s)[None, :], ctx_len - 1)
            feeds = {
                "input_ids": ids,
                "attention_mask": kv.mask(s),  # [n, W+S]
                "position_ids": positions.astype(np.int64),  # [n, S]
                **kv.feeds(),
            }
            feeds = with_causal_tree_mask(self.session, feeds)  # a --tree-mask artifact
            fetch = self._lean_fetch if trust else self.output_names
            t0 = time.perf_counter()
            outputs = self.session.run(fetch, feeds)
            ort_s += time.perf_counter() - t0
            batch_steps += 1
            named = dict(zip(fetch, outputs))
            if trust:  # presents and the three mtp_* outputs only; no logits left the graph
                presents = outputs[: self.n_kv]
                result = self._graph_verify(drafts, named)
            else:
                presents = outputs[1 : 1 + self.n_kv]
                ctxs = [contexts[b] for b in live.tolist()]
                result = verifier.chain(drafts, outputs[0], ctxs)
            keep = kv.lengths + result.accepted + 1
            observed = self._observed or named  # MTP rows read only the mtp_* outputs
            alive = np.ones(live.size, dtype=bool)
            for i, b in enumerate(live.tolist()):
                stats[b].observe_draft(int(drafts.lengths[i]), int(result.accepted[i]))
                controller = controllers[b]
                if controller is not None:
                    controller.observe(int(drafts.lengths[i]), int(result.accepted[i]))
                row_out = {k: named[k][i : i + 1] for k in observed}
                row_res = VerifyResult(
                    result.accepted[i : i + 1], [result.tokens[i]], result.bonus[i : i + 1]
                )
                proposers[b].observe(row_out, row_res)
                for tok in result.tokens[i]:
                    out[b].append(tok)
                    contexts[b].append(tok)
                    done = True
                    if tok in eos:
                        reasons[b] = "eos"
                    elif on_token is not None and on_token(b, tok):
                        reasons[b] = "stop"
                    elif len(out[b]) >= budgets[b]:
                        reasons[b] = "context" if budgets[b] < max_new_tokens else "length"
                    else:
                        done = False
                    if done:
                        alive[i] = False
                        break
            if t_first is None:
                t_first = time.perf_counter()
            stay = np.flatnonzero(alive)
            start = kv.width - kv.lengths  # old cache right-aligned at W-1, new tokens from W
            if self.record_kv:
                for j in np.flatnonzero(~alive).tolist():
                    a, z = int(start[j]), int(start[j] + keep[j])
                    self.row_kv[int(live[j])] = [np.array(p[j : j + 1, :, a:z]) for p in presents]
            kv.compact(presents, start, keep, stay)
            live = live[stay]
        t_end = time.perf_counter()

        total = SpecDecodingStats()
        for st in stats:
            total.merge(st)
        total.log("batched spec decode")
        new_tokens = sum(len(o) for o in out)
        decode_wall = t_end - t_prefill
        metrics: dict[str, Any] = {
            "batch": n_rows,
            "prompt_tokens": sum(len(r) for r in rows),
            "new_tokens": new_tokens,
            "ttft_ms": round(((t_first or t_end) - t_start) * 1e3, 3),
            "prefill_s": round(t_prefill - t_start, 6),
            "decode_steps": batch_steps,  # batched verify runs (each serves every live row)
            "decode_tok_per_s": round(new_tokens / decode_wall, 2) if decode_wall > 0 else None,
            "tpot_ms": round(decode_wall / batch_steps * 1e3, 4) if batch_steps else None,
            "decode_ort_s": round(ort_s - prefill_ort, 6),
            "decode_wall_s": round(decode_wall, 6),
            "propose_s": round(propose_s, 6),
            "step_overhead_ms": overhead_ms(decode_wall, ort_s - prefill_ort, batch_steps),
            "total_s": round(t_end - t_start, 6),
            "kv_layout": "concat",
            "speculative": {
                "method": self.method,
                "num_draft": self.num_draft,
                "adaptive": self.adaptive,
                **total.as_dict(),
                "rows": [st.as_dict() for st in stats],
            },
        }
        return BatchSpeculativeOutput(out, reasons, metrics, stats)

    # ---- pieces ----------------------------------------------------------------------
    def _can_trust_graph(self, sampling: SamplingConfig, proposers: list[Proposer]) -> bool:
        """Greedy MTP without a penalty: the graph's argmax verification is the host's."""
        return (
            self.trust_graph
            and sampling.greedy
            and sampling.repetition_penalty == 1.0
            and len(self._observed) == 3
            and all(p.graph_verifies for p in proposers)
        )

    def _graph_verify(self, drafts: Drafts, named: dict[str, np.ndarray]) -> VerifyResult:
        """The graph's own greedy verdict (``mtp_accepted`` / ``mtp_bonus`` [n]); a row whose
        filler the graph accepted past its drafts gets the MTP proposer's mismatch path."""
        info = (self.manifest.mtp or {})["outputs"]
        acc = named[info["accepted"]].reshape(-1).tolist()  # [n] int64
        bonus = named[info["bonus"]].reshape(-1).tolist()  # [n] int64
        return graph_verdict(drafts, acc, bonus, FILLER)

    def _row_proposer(self, b: int, sampling: SamplingConfig) -> Proposer:
        proposer = adopt(self.make_row_proposer())
        proposer.start(sampling, stream=b)  # rows draw from independent (still seeded) streams
        return proposer

    def _prefill(self, kv: PaddedKV, rows: list[list[int]]) -> float:
        """Run every row's prompt minus its last token, left-padded; return seconds in ORT."""
        lengths = np.array([len(r) - 1 for r in rows], dtype=np.int64)
        width = int(lengths.max())
        ids = np.full((len(rows), width), FILLER, dtype=np.int64)  # [B, W]
        mask = np.zeros((len(rows), width), dtype=np.int64)  # [B, W]
        for i, r in enumerate(rows):
            if lengths[i]:
                ids[i, width - lengths[i] :] = r[:-1]
                mask[i, width - lengths[i] :] = 1
        positions = np.where(mask > 0, np.cumsum(mask, axis=1) - 1, 0).astype(np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **kv.feeds()}
        feeds = with_causal_tree_mask(self.session, feeds)  # a --tree-mask artifact
        t0 = time.perf_counter()
        outputs = self.session.run(self.output_names, feeds)
        seconds = time.perf_counter() - t0
        # Zero every pad slot: a row with nothing to prefill is all padding (maybe NaN values).
        presents = outputs[1 : 1 + self.n_kv]
        kv.compact(presents, width - lengths, lengths, np.arange(len(rows)), pad_is_zero=False)
        return seconds

    def _propose(
        self,
        live: np.ndarray,
        kv: PaddedKV,
        proposers: list[Proposer],
        controllers: list[AdaptiveDraftLength | None],
        contexts: list[list[int]],
        out: list[list[int]],
        budgets: list[int],
    ) -> Drafts:
        """Per live row: up to K drafts within its budget and the context window."""
        ctx_len = self.manifest.context_length
        tokens: list[list[int]] = []
        probs: list[np.ndarray | None] = []
        for i, b in enumerate(live.tolist()):
            room = min(budgets[b] - len(out[b]) - 1, ctx_len - 1 - int(kv.lengths[i]))
            controller = controllers[b]
            k = min(self.num_draft if controller is None else controller.choose(), room)
            if k <= 0:
                tokens.append([])
                probs.append(None)
                continue
            d = proposers[b].propose([contexts[b]], k)
            row = d.row(0)[:k]
            tokens.append(row)
            probs.append(None if d.probs is None else d.probs[0, : len(row)])
        width = max((len(t) for t in tokens), default=0)
        q = None
        if any(p is not None and len(p) for p in probs):
            q = np.zeros((len(tokens), width, self.manifest.vocab_size), dtype=np.float64)
            for i, p in enumerate(probs):
                if p is not None and len(p):
                    q[i, : len(p)] = p
        return Drafts.from_lists(tokens, q)


def generate_speculative_batch(
    model: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    method: str,
    num_draft: int,
    draft_model: Any | None = None,
    sampling: SamplingConfig | None = None,
    eos_ids: Sequence[int] = (),
    on_token: OnRowToken | None = None,
    adaptive: bool | None = None,
) -> tuple[list[list[int]], list[str], dict[str, Any]]:
    """Speculative generation for several prompts with a loaded ``specport.api.Model``.

    ``method``: ``ngram`` | ``draft`` (needs ``draft_model``, same vocabulary; one draft cache
    per row) | ``mtp`` (an artifact with MTP heads). ``on_token(row, token)`` returning True
    stops that row ("stop"). ``adaptive``: each row picks its draft length per step from its
    recent acceptance (``metrics.AdaptiveDraftLength``; None = the batch-1 default for the
    method, ``loop.default_adaptive``). Returns (new tokens per row, finish reason per row, metrics);
    metrics carry the batch-1 speculative counters summed over rows plus ``rows`` (per row).
    """
    num_draft = check_num_draft(num_draft)
    first = make_proposer(method, model, num_draft, draft_model)  # validates, clear errors
    gen = BatchSpeculativeGenerator(
        model.session,
        model.manifest,
        lambda: make_proposer(method, model, num_draft, draft_model),
        num_draft,
        method,
        default_adaptive(first) if adaptive is None else bool(adaptive),
    )
    out = gen.generate(prompts, max_new_tokens, sampling, eos_ids, on_token)
    out.metrics["provider"] = getattr(model, "provider", None)
    return out.tokens, out.finish_reasons, out.metrics
