"""The synchronous driver of the one step: several prompts (or one) decoded to the end, in order.

``generate_rows`` is what ``Model.generate`` and ``Model.generate_batch`` run, with
``speculative=...`` or without (plain decoding, ``runtime.generator.Generator``: the step with
no proposer), on either KV layout (one prompt is a batch of one): every prompt gets a row of
one ``KVCache``, is prefilled (without its last token, which the first step feeds with the
first drafts; plain decoding prefills it whole and picks the first token from its scores),
and then every live row takes part in each
``engine.step`` — propose, one run over every row's ``[last, drafts]``, verify, commit — until
it stops (EOS, a stop string, its token budget). Rows that drafted nothing decode in that same
run. A row whose drafts form a token tree, or, where the graph cannot take several new tokens
per row at batch > 1 (artifacts exported before ``query_seqlens``, see
``takes_batched_steps``), a row with drafts verifies alone at batch 1, and the others decode
together, as in the serving engine.

The verifier is chosen once per request (``verify.make_verifier``): under plain greedy decoding
with a proposer whose graph verifies its own drafts (an MTP branch) it is the graph's verdict,
read from the run's outputs instead of recomputed on the host.

One prompt on a cache kept from the previous call (``cache`` and ``held``, the ids its row
holds) prefills only what follows their common prefix: a chat's next turn starts with the
previous turn's prompt and answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from specport.runtime.engine import step
from specport.runtime.engine.prefix_cache import common_prefix
from specport.runtime.engine.step_cost import LiveVerifyCosts
from specport.runtime.kv.cache import SharedKVCache, open_kv_cache, session_takes_batched_steps
from specport.runtime.kv.interface import KVCache
from specport.runtime.kv.seq_cache import context_limit
from specport.runtime.sampler import Sampler, SamplingConfig
from specport.runtime.speculative.base import Drafts, Proposer, check_prompts, stop_reason
from specport.runtime.speculative.draft import CATCH_UP
from specport.runtime.speculative.metrics import (
    AdaptiveDraftLength,
    SpecDecodingStats,
    timing_metrics,
)
from specport.runtime.speculative.verify import Verifier, graph_outputs, make_verifier

logger = logging.getLogger(__name__)

MAX_DRAFT_SLACK = 17  # positions past a row's budget a wide run may write (1 + MAX_DRAFT)

# A batch-1 call's buffers hold at least this many positions (or the context, if shorter), so
# later calls that extend its sequence find them long enough and reuse its KV. numpy backs them
# with 2 MiB pages, so the first token commits them whole: 94 MB for SmolLM2-135M fp32, once
# per loaded model (kept: 4 KiB pages measured slower decode in the serving engine).
BATCH_1_POSITIONS = 2048

# on_token(row, token) -> True to stop that row here (e.g. a stop string matched)
OnRowToken = Callable[[int, int], "bool | None"]
# select(row, logits [1, V]) -> the row's next token (a caller's own sampler)
RowSelect = Callable[[int, np.ndarray], int]


@dataclass
class RowsOutput:
    tokens: list[list[int]]  # new tokens per row (EOS included when it ended the row)
    finish_reasons: list[str]  # "eos" | "length" | "stop" | "context"
    metrics: dict[str, Any] = field(default_factory=dict)
    cache: KVCache | None = None  # the KV after the last step (reusable by the next call)
    stats: list[SpecDecodingStats] = field(default_factory=list)  # acceptance per row
    held: list[int] | None = None  # one row: the ids whose KV ``cache`` holds (see ``held``)


def generate_rows(
    model: Any,  # specport.api.Model (shared layout)
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    make_proposer: Callable[[], Proposer] | None,
    num_draft: int,
    sampling: SamplingConfig | None = None,
    eos_ids: Sequence[int] = (),
    on_token: OnRowToken | None = None,
    adaptive: bool = False,
    method: str = "custom",
    *,
    session: Any = None,
    cache: KVCache | None = None,
    graph_verify: bool = True,
    tree_width: int = 0,
    held: Sequence[int] | None = None,
    live_costs: LiveVerifyCosts | None = None,
    select: RowSelect | None = None,
) -> RowsOutput:
    """Decode ``prompts`` together through the one step (see the module docstring).

    ``session``: run this session instead of ``model.session`` (a stored variant of the same
    graph, e.g. MTP trees' verify graph); ``cache``: a cache from an earlier call to reuse
    when it is large enough (its buffers stay allocated and bound); ``graph_verify``: trust
    an MTP branch's in-graph verdict under plain greedy decoding (False: verify on the host);
    ``tree_width``: the widest token tree the proposer drafts (KV room for its nodes; 0 for
    chains); ``held``: the ids whose KV ``cache``'s row 0 holds (an earlier call's
    ``RowsOutput.held``): one prompt on the shared layout prefills only what follows their
    common prefix. ``live_costs``: what verifying k drafts costs on this machine, as the
    model's tracker has it (``engine.step_cost.live_verify_costs``): a greedy batch-1 row's
    adaptive draft length weighs it in place of its linear prior, and its timed steps correct
    it (probing one draft now and then while too few one-draft verifies were timed).
    ``select``: the caller's choice of a row's token from its scores in place of the
    request's verifier (plain decoding's sampler, which keeps per-row histories of its own).

    Without a proposer this is plain decoding: every step has width 1 and takes the step's
    one-token path (``step._decode``)."""
    manifest = model.manifest
    session = session if session is not None else model.session
    limit = context_limit(manifest)
    rows = check_prompts(prompts, max_new_tokens, limit, manifest.vocab_size)
    n = len(rows)
    sampling = sampling or SamplingConfig()
    sampler = Sampler(sampling, manifest.vocab_size)
    budgets = [min(max_new_tokens, limit - len(r)) for r in rows]
    slack = max(MAX_DRAFT_SLACK, 1 + num_draft * tree_width)  # a tree's nodes take slots
    length = min(limit, max(len(r) + b for r, b in zip(rows, budgets)) + slack)
    if (
        cache is None
        or cache.rows != n
        or cache.max_length < length
        or cache.session is not session
    ):
        if n == 1:  # room for a chat's next turns
            length = min(limit, max(2 * length, BATCH_1_POSITIONS))
        cache, held = open_kv_cache(session, manifest, n, length), None  # the artifact's layout
    cache.reset()
    reuse = 0  # prompt positions whose KV the cache already holds
    if held is not None and n == 1 and manifest.kv.layout == "shared":
        prompt = np.asarray(rows[0], dtype=np.int64)
        reuse = min(common_prefix(np.asarray(held, dtype=np.int64), prompt), len(prompt) - 1)
        cache.lengths[0] = reuse
    held_out: list[int] | None = None
    length = cache.max_length
    batched = (
        n == 1
        or make_proposer is None  # no drafts: every run is one token per row
        or manifest.kv.layout == "concat"  # left padding: any rows, any width
        or session_takes_batched_steps(session, Path(model.path) / manifest.model_file)
    )
    proposers: list[Proposer | None] = []
    for r in range(n):
        proposer = make_proposer() if make_proposer is not None else None
        if proposer is not None:
            proposer.start(sampling, stream=r, budget=budgets[r])  # independent (seeded) rows
            proposer.share_target_kv(cache, r)  # a draft cut or quantized from it: in its KV
        proposers.append(proposer)
    first = proposers[0]
    graph = None  # an MTP branch's own verdict (a tree-mask graph's branch is not used)
    if graph_verify and first is not None and first.graph_verifies and not cache.has_tree:
        graph = graph_outputs(manifest)
    verifier = make_verifier(sampler, graph)  # chosen once, from the request's settings
    controllers = [
        _controller(p, num_draft, manifest) if adaptive and p is not None else None
        for p in proposers
    ]
    # Timings steer K only under greedy decoding at batch 1, where K cannot change the output
    # and the step's time is the row's own; with sampling K decides how the random stream is
    # consumed, so a seeded run must not depend on the clock (the static prior stays).
    timed = n == 1 and sampling.greedy and controllers[0] is not None
    live_costs = live_costs if timed else None
    if live_costs is not None:
        controllers[0].set_verify_costs(live_costs.costs[: num_draft + 1])  # type: ignore[union-attr]
    per_draft = first is not None and first.draft_cost(manifest) > 0
    stats = [SpecDecodingStats() for _ in range(n)]
    contexts = [list(r) for r in rows]
    out: list[list[int]] = [[] for _ in range(n)]
    reasons = ["length"] * n
    eos = {int(e) for e in eos_ids}
    stops = [None if on_token is None else partial(on_token, r) for r in range(n)]
    plan = []  # one StepRow per row, kept across steps (its context grows in place)
    for r in range(n):
        pick = (
            _picker(sampling, verifier, contexts[r])
            if select is None
            else partial(_selected, select, r)
        )
        row = step.StepRow(r, contexts[r], pick)
        row.proposer, row.verifier = proposers[r], verifier
        plan.append(row)
    live = list(plan)
    runs = 0
    propose_s = 0.0
    nodes = 0
    # (cap, start, propose seconds, drafts verified, tokens the proposer caught up on, context)
    # of the last step, timed by the tracker's clock (process CPU time on the CPU provider:
    # waits for a core are not a step's cost)
    last_step: tuple[int, float, float, int, int, int] | None = None
    clock = live_costs.clock if live_costs is not None else time.perf_counter

    def emit(row: step.StepRow, tokens: list[int]) -> None:
        """Append a row's new tokens up to the first that stops it (then free its row)."""
        nonlocal held_out
        r = row.row
        for tok in tokens:
            out[r].append(tok)
            contexts[r].append(tok)
            why = stop_reason(tok, len(out[r]), eos, stops[r], budgets[r], max_new_tokens)
            if why is not None:
                reasons[r] = why
                live.remove(row)
                if n == 1:  # what the next call may reuse (KV past EOS is not held)
                    held_out = contexts[r][: int(cache.lengths[r])]
                cache.free(r)  # concat: out of the next runs' KV
                return

    # Plain decoding runs each prompt whole and picks the first token from its last scores
    # (one run fewer than feeding the last token to the first step); with a proposer the
    # last prompt token waits for the first step, which feeds it with the first drafts.
    whole = make_proposer is None
    t_start = time.perf_counter()
    scores = _prefill(cache, rows, reuse, whole)
    t_prefill, c_prefill = time.perf_counter(), time.process_time()
    prefill_ort = cache.ort_seconds
    t_first: float | None = None
    for row, (logits, greedy) in zip(list(live), scores):
        emit(row, [row.pick(logits, greedy)])
    if scores:
        t_first = time.perf_counter()
    while live:
        if make_proposer is None:  # plain decoding: one run of width 1 over every live row
            groups = [(list(live), 1, len(live) == 1)]
        else:
            for row in live:
                r = row.row
                if row.proposer is not None:
                    row.room = length - 1 - int(cache.lengths[r])
                    room = min(budgets[r] - len(out[r]) - 1, row.room)
                    ctl = controllers[r]
                    row.cap = min(num_draft if ctl is None else ctl.choose(), room)
                    if not row.cap and room > 0 and live_costs is not None and live_costs.probe():
                        row.cap = 1  # a one-draft verify timed for the costs (greedy: same tokens)
            t0, c0 = time.perf_counter(), clock()
            if timed and last_step is not None:  # the previous step's share of proposing
                cap, t_prev, propose_prev, fed, caught_up, context = last_step
                rest = c0 - t_prev - propose_prev
                if caught_up <= CATCH_UP:  # a draft model's prefill priced it out for good
                    controllers[0].observe_cost(cap, propose_prev, rest, per_draft)  # type: ignore[union-attr]
                if live_costs is not None and live_costs.observe(fed, rest, context):
                    controllers[0].set_verify_costs(live_costs.costs[: num_draft + 1])  # type: ignore[union-attr]
            widest = step.propose(live)
            t1 = time.perf_counter()
            propose_s += t1 - t0
            if timed:
                caught_up = int(getattr(live[0].proposer, "caught_up", 0))
                fed_now = int(live[0].drafts.lengths[0])
                at = len(contexts[live[0].row])
                last_step = (live[0].cap, c0, clock() - c0, fed_now, caught_up, at)
            groups = _groups(list(live), widest, batched, cache)
        for group, width, alone in groups:
            verdicts = step.run(cache, group, width, alone)
            runs += 1
            for row, verdict in zip(group, verdicts):
                r = row.row
                if verdict.error is not None:
                    raise RuntimeError(verdict.error)
                if row.proposer is not None:
                    stats[r].observe_draft(verdict.drafted, verdict.accepted)
                    nodes += verdict.nodes
                    ctl = controllers[r]
                    if ctl is not None:
                        ctl.observe(verdict.drafted, verdict.accepted)
                emit(row, verdict.tokens)
        if t_first is None:
            t_first = time.perf_counter()
    t_end, c_end = time.perf_counter(), time.process_time()
    metrics = _metrics(
        rows, out, stats, runs, (t_start, t_prefill, t_first or t_end, t_end),
        cache.ort_seconds - prefill_ort, propose_s, method, num_draft, adaptive,
        make_proposer is not None,
    )  # fmt: skip
    # the decode's process CPU time, over the span of ``decode_wall_s``: what a bench compares
    # on a loaded machine (waits for a core are not counted), without the prefill, which a
    # prompt prefix kept from the previous call makes cheaper for some calls than for others
    metrics["decode_cpu_s"] = round(c_end - c_prefill, 6)
    metrics["kv_layout"] = manifest.kv.layout
    metrics["cached_prompt_tokens"] = reuse  # only a batch of one reuses a held sequence
    if n == 1:
        choices = getattr(first, "choices", None)  # auto: what it chose, step by step
        if isinstance(choices, dict) and "speculative" in metrics:
            metrics["speculative"]["choices"] = dict(choices)
        profile = getattr(first, "profile", None)  # auto: what it measured of the prompt
        if profile is not None and "speculative" in metrics:
            metrics["speculative"]["prompt"] = profile.as_dict()
    if tree_width and "speculative" in metrics:
        steps = metrics["speculative"].get("steps") or 0
        metrics["speculative"].update(
            tree_width=tree_width,
            # drafted/accepted count the deepest branch per step (comparable to a chain);
            # tree_nodes counts every scored draft node
            tree_nodes=nodes,
            mean_tree_nodes=nodes / steps if steps else 0.0,
        )
    if make_proposer is not None and n == 1:
        stats[0].log()
    return RowsOutput(out, reasons, metrics, cache, stats, held_out)


def _prefill(
    cache: KVCache, rows: list[list[int]], reuse: int, whole: bool
) -> list[tuple[np.ndarray, int | None]]:
    """Run each prompt past its ``reuse`` cached positions into its row: whole (returning each
    row's last scores [1, V] and the graph's argmax there, or None) or all but its last token
    (returning nothing). Several prompts on the in-place cache share one run (right-padded,
    ``SharedKVCache.prefill_rows``)."""
    chunks = [p[reuse : len(p) if whole else len(p) - 1] for p in rows]
    lengths = [len(c) for c in chunks]
    if len(rows) > 1 and not reuse and all(lengths) and isinstance(cache, SharedKVCache):
        ids = np.zeros((len(rows), max(lengths)), dtype=np.int64)
        for i, c in enumerate(chunks):
            ids[i, : len(c)] = c
        out = cache.prefill_rows(0, ids, np.asarray(lengths, dtype=np.int64))
        outs = [
            (out.logits[i], None if out.greedy is None else out.greedy[i]) for i in range(len(rows))
        ]
    else:
        outs = []
        for r, c in enumerate(chunks):
            if c:
                one = cache.step_row(r, np.asarray(c, dtype=np.int64), last_only=True)
                outs.append((one.logits[0], None if one.greedy is None else one.greedy[0]))
    if not whole:
        return []
    # [1, V] each; the argmax as an int (views of a row's buffers: read before its next run)
    return [(logits[-1:], None if g is None else int(g[-1])) for logits, g in outs]


def _groups(
    plan: list[step.StepRow], widest: int, batched: bool, cache: KVCache
) -> list[tuple[list[step.StepRow], int, bool]]:
    """The runs of one step: (rows, width, alone). Token trees and, on graphs without batched
    multi-token steps, every row with drafts verify alone; the rest share one run."""
    if len(plan) == 1:  # one row runs on its own binding: no batch bookkeeping
        return [(plan, 1 + int(plan[0].drafts.lengths[0]), True)]
    trees = [p for p in plan if p.drafts.tree is not None]
    if not trees and (batched or widest == 0):
        width = 1 + widest
        if not cache.fits(plan[-1].row + 1, width):
            width = 1  # a finished row near the end of its buffer: decode plainly
        return [(plan, width, False)]
    alone = [p for p in plan if p.drafts.tree is not None or (not batched and p.drafts.width)]
    groups = [([p], 1 + p.drafts.width, True) for p in alone if int(p.drafts.lengths[0])]
    rest = [p for p in plan if p not in alone or not int(p.drafts.lengths[0])]
    if rest:
        width = 1 + max(int(p.drafts.lengths[0]) for p in rest) if batched else 1
        if not cache.fits(rest[-1].row + 1, width):
            width = 1
        groups.append((rest, width, False))
    return groups


def _controller(proposer: Proposer, num_draft: int, manifest: Any) -> AdaptiveDraftLength:
    """The adaptive-K controller with a static prior on what a draft costs."""
    ctl = AdaptiveDraftLength(num_draft, extend=True)
    cost = proposer.draft_cost(manifest)  # e.g. one draft-model run per draft
    if cost > 0:
        ctl.cost_per_draft += cost
        ctl.prior_cost = ctl.cost_per_draft
    return ctl


def _picker(sampling: SamplingConfig, verifier: Verifier, context: list[int]) -> step.Pick:
    """A row's token without drafts: the graph's argmax under plain greedy decoding, else the
    verifier's choice from the target's scores (penalties, grammar, the seeded stream)."""
    if sampling.greedy and sampling.plain:
        return lambda logits, greedy: greedy if greedy is not None else int(np.argmax(logits[0]))
    return lambda logits, greedy: int(verifier.chain(_EMPTY, logits[None], (context,)).tokens[0][0])


def _selected(select: RowSelect, row: int, logits: np.ndarray, greedy: int | None) -> int:
    return select(row, logits)


_EMPTY = Drafts.empty(1)


def _metrics(
    rows: list[list[int]],
    out: list[list[int]],
    stats: list[SpecDecodingStats],
    runs: int,
    clock: tuple[float, float, float, float],
    decode_ort: float,
    propose_s: float,
    method: str,
    num_draft: int,
    adaptive: bool,
    speculative: bool,
) -> dict[str, Any]:
    """The generators' timing keys (``speculative.metrics.timing_metrics``, the same keys as
    every loop) for a batch, plus the acceptance counters per row."""
    first_s, prefill, first, end = clock
    metrics = timing_metrics(
        sum(len(r) for r in rows),
        sum(len(o) for o in out),
        runs,
        {"start": first_s, "prefill": prefill, "first": first, "end": end},
        decode_ort,
        0.0,
        propose_s,
    )
    metrics.update(batch=len(rows), kv_layout="shared")
    if speculative:
        total = SpecDecodingStats()
        for st in stats:
            total.merge(st)
        metrics["speculative"] = {
            "method": method,
            "num_draft": num_draft,
            "adaptive": adaptive,
            **total.as_dict(),
            "rows": [st.as_dict() for st in stats],
        }
    return metrics
