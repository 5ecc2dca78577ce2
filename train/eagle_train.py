"""Train an EAGLE draft head on a feature cache for a bounded time, resumably.

The head (``exporter.eagle_head``, trained through ``eagle_objective``) learns the target's own greedy choices from the target's features
(``eagle_cache``), with the training-time test over ``depth`` chained drafts. Training stops
after ``minutes`` of wall time (the time already spent before a resume counts), saves a
checkpoint about every minute (``checkpoint.pt`` beside the cache: a rerun of the same command
continues from it) and measures the held-apart sequences' acceptance per draft position about
a dozen times per run, so one run also reports acceptance against training time.

Where the time goes (SmolLM2-135M, 8192-token draft vocabulary, depth 4, 2 cores): a step is
about 210 MFLOP per trained position (the draft-vocabulary LM head is half of it, the MLP a
quarter), so its cost is the arithmetic, ~40 GFLOP per CPU-second on one AVX2 core. What
wasted it was torch's second thread on a loaded machine: each of the ~300 ops of a step ends
in an OpenMP barrier that waits for a descheduled thread, and at load 7-9 on 2 cores two
threads trained 47-96 positions per CPU-second against 160-206 with one (2-3x the wall time
per step). ``torch_threads`` therefore drops to one thread while other work fills the cores
and takes the asked threads back when they are free, re-checked at every checkpoint.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from specport.core.progress import Loop
from specport.exporter.eagle_head import EagleConfig, EagleHead
from specport.train.eagle_cache import LABELS, FeatureCache
from specport.train.eagle_objective import ttt_loss

logger = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
# the timeline's acceptance is measured on the first held-out sequences holding about this
# many positions (standard error ~0.01 at rate 0.3): the whole split, measured a dozen times,
# cost as much wall time as the training between the points on a loaded machine
TIMELINE_POSITIONS = 2048
TIMELINE_POINTS = 12


def torch_threads(wanted: int, in_use: int) -> int:
    """Threads for torch now: ``wanted`` while the other work on the machine leaves that many
    cores free, else 1 (see the module doc: a second OpenMP thread that waits for a busy core
    makes every op wait too). ``in_use`` is the threads this process has been running, which
    the load average already counts."""
    if wanted <= 1:
        return 1
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform: trust the caller
        return wanted
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    others = max(0.0, load - in_use)
    return wanted if others + wanted <= (cores or 1) + 0.5 else 1


def trained_minutes(checkpoint: Path) -> float:
    """Minutes of training a checkpoint holds (0.0 without one)."""
    if not Path(checkpoint).is_file():
        return 0.0
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    return float(saved["state"]["elapsed"]) / 60.0


def timeline_rows(cache: FeatureCache, rows: Sequence[int]) -> list[int]:
    """The first of ``rows`` holding about TIMELINE_POSITIONS answer positions (at least one)."""
    picked: list[int] = []
    seen = 0
    for i in rows:
        picked.append(int(i))
        seen += int(cache.offsets[int(i) + 1] - cache.offsets[int(i)]) - int(cache.prompts[int(i)])
        if seen >= TIMELINE_POSITIONS:
            break
    return picked


class Batch(NamedTuple):
    """A training or evaluation batch (see ``batch_tensors``)."""

    features: torch.Tensor  # [B, T, 3H]
    next_ids: torch.Tensor  # [B, T] the token at t+1
    labels: torch.Tensor  # [B, T] draft index of the target's choice after t+1, -1 / -2
    soft: tuple[torch.Tensor, torch.Tensor] | None  # draft indices [B, T, K] (-1: none), probs

    def to(self, device: str) -> Batch:
        soft = None if self.soft is None else (self.soft[0].to(device), self.soft[1].to(device))
        return Batch(
            self.features.to(device), self.next_ids.to(device), self.labels.to(device), soft
        )


def batch_tensors(
    cache: FeatureCache,
    rows: Sequence[int],
    to_draft: np.ndarray,
    soft: bool = False,
) -> Batch:
    """Features [B, T, 3H], next ids [B, T] and labels [B, T] for sequences ``rows``.

    Position t's input token is the one at t+1 and its label the target's choice after t+1
    (the token at t+2) as a draft-vocabulary index: -2 where the target chose a token outside
    it, -1 where there is nothing to learn (padding). Each sequence starts at the prompt's
    last token, the first position whose features a decoding loop shows the head (the loops
    prefill all but the last prompt token and show the head the outputs of the decode steps
    only: the first step feeds that token and drafts nothing), so the head trains on the KV
    it has at runtime (a head trained on whole sequences, its KV holding the prompt's
    positions too, did no better: see the guide). ``soft``
    (with a cache that holds them): the target's top-K choices after t+1 as draft indices
    (-1 outside the draft vocabulary) and their probabilities, the soft labels."""
    parts = []
    for i in rows:
        f, tok, ch, p = cache.sequence(int(i))
        t = len(tok) - 1
        lab = to_draft[ch[1:]]
        first = min(max(p - 1, 0), t - 1)  # a prompt filling the sequence keeps one label
        top = cache.soft(int(i)) if soft else None
        extra = None
        if top is not None:
            ids = to_draft[np.asarray(top[0][first + 1 :], np.int64)]
            # to_draft's -2 (outside the draft vocabulary) becomes -1: no weight in the soft loss
            extra = (np.where(ids >= 0, ids, -1), np.asarray(top[1][first + 1 :], np.float32))
        parts.append((np.asarray(f[first:t], np.float32), tok[first + 1 :], lab[first:], extra))
    width = max(len(p[1]) for p in parts)
    dim = parts[0][0].shape[-1]
    feats = np.zeros((len(parts), width, dim), np.float32)
    ids = np.zeros((len(parts), width), np.int64)
    labels = np.full((len(parts), width), -1, np.int64)
    with_soft = all(p[3] is not None for p in parts)
    k = parts[0][3][0].shape[-1] if with_soft and parts[0][3] is not None else 0
    soft_ids = np.full((len(parts), width, k), -1, np.int64)
    soft_probs = np.zeros((len(parts), width, k), np.float32)
    for b, (f, tok, lab, extra) in enumerate(parts):
        feats[b, : len(tok)] = f
        ids[b, : len(tok)] = tok
        labels[b, : len(tok)] = lab
        if with_soft and extra is not None:
            soft_ids[b, : len(tok)] = extra[0]
            soft_probs[b, : len(tok)] = extra[1]
    return Batch(
        torch.from_numpy(feats),
        torch.from_numpy(ids),
        torch.from_numpy(labels),
        (torch.from_numpy(soft_ids), torch.from_numpy(soft_probs)) if with_soft else None,
    )


def draft_map(draft_ids: np.ndarray, vocab: int) -> np.ndarray:
    """target id -> draft-vocabulary index, -2 for ids outside it."""
    to_draft = np.full(vocab, -2, dtype=np.int64)
    to_draft[draft_ids] = np.arange(len(draft_ids))
    return to_draft


@torch.no_grad()
def acceptance(
    head: EagleHead,
    cache: FeatureCache,
    rows: Sequence[int],
    to_draft: np.ndarray,
    depth: int,
    device: str = "cpu",
    batch: int = 8,
) -> dict[str, Any]:
    """Greedy acceptance on ``rows``, as a decoding loop drafting ``depth`` tokens per verify
    step would see it (see ``chain_acceptance``), and what the loss trains: each depth's
    accuracy over every position, right or wrong before it (``accuracy_per_depth``)."""
    head.eval()
    hits = np.zeros(depth, np.int64)
    seen = np.zeros(depth, np.int64)
    tested = np.zeros(depth, np.int64)
    accepted = np.zeros(depth, np.int64)
    for i in range(0, len(rows), batch):
        b = batch_tensors(cache, rows[i : i + batch], to_draft).to(device)
        res = ttt_loss(head, b.features, b.next_ids, b.labels, depth)
        for j, (c, n) in enumerate(res.stats):
            hits[j] += c
            seen[j] += n
        t, a = chain_counts(res.right.cpu().numpy(), res.counted.cpu().numpy())
        tested += t
        accepted += a
    head.train()
    return chain_acceptance(tested, accepted) | {
        "accuracy_per_depth": [round(float(h) / max(int(s), 1), 4) for h, s in zip(hits, seen)],
    }


def chain_counts(right: np.ndarray, counted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(tested, accepted) per draft position k of the chains a decoding loop drafts.

    ``right``/``counted`` [depth, B, T] are ``ttt_loss``'s: depth j at position t drafts for
    the origin o = t - j. A chain from o tests draft k only when drafts 0..k-1 were accepted
    (the loop verifies the prefix and stops at the first miss), exactly as at runtime, where
    draft k is fed the accepted tokens and the head's own hidden states."""
    depth, _, t = right.shape
    alive = None
    tested = np.zeros(depth, np.int64)
    accepted = np.zeros(depth, np.int64)
    for k in range(depth):
        r = np.zeros_like(right[k])  # by origin: r[:, o] = right[k][:, o + k]
        c = np.zeros_like(counted[k])
        r[:, : t - k] = right[k][:, k:]
        c[:, : t - k] = counted[k][:, k:]
        here = c if alive is None else c & alive
        tested[k] = int(here.sum())
        alive = here & r
        accepted[k] = int(alive.sum())
    return tested, accepted


def chain_acceptance(tested: np.ndarray, accepted: np.ndarray) -> dict[str, Any]:
    """Acceptance per draft position given the earlier drafts were accepted (what the
    adaptive draft length estimates), the share of chains that reach past each position
    (what ``bench`` reports per position at a fixed K), and the tokens a verify step of
    ``len(tested)`` drafts then yields on average (1 + the accepted prefix)."""
    rates = [float(a) / max(int(t), 1) for t, a in zip(tested, accepted)]
    reach = [float(np.prod(rates[: k + 1])) for k in range(len(rates))]
    return {
        "acceptance_per_position": [round(r, 4) for r in rates],
        "reach_per_position": [round(r, 4) for r in reach],
        "expected_tokens_per_step": round(1.0 + sum(reach), 3),
        "positions": int(tested[0]) if len(tested) else 0,
    }


def train_head(
    cache: FeatureCache,
    cfg: EagleConfig,
    embed: torch.Tensor,  # [V, H] the target's token embedding
    draft_ids: np.ndarray,  # [Vd] target ids the head predicts
    train_rows: Sequence[int],
    eval_rows: Sequence[int],
    work: Path,
    minutes: float,
    depth: int = 4,
    batch: int = 2,
    lr: float = 2e-3,
    device: str = "cpu",
    progress: bool | None = None,
    checkpoint_seconds: float = 60.0,
    max_steps: int = 0,  # > 0: stop after this many steps as well (tests, fixed-step comparisons)
    threads: int = 2,
    also: dict[str, FeatureCache] | None = None,
    labels: str = "soft",
) -> tuple[EagleHead, dict[str, Any]]:
    """The head trained for ``minutes`` (resuming ``work/checkpoint.pt`` if there is one).

    Small batches (2 whole sequences, ~300 positions x ``depth``): a step costs its arithmetic
    (see the module doc), so per position a batch of 8 trained no faster per CPU-second than
    a batch of 2 (188-193 vs 161-206 positions, one thread), and 2 give 4x the updates for the
    same positions seen. Held-out acceptance goes into the timeline every
    ``max(checkpoint_seconds, minutes / TIMELINE_POINTS)`` on the first held-out sequences
    (``timeline_rows``) and once at the end on the whole held-out split. ``also``: other
    evaluation sets (e.g. the benchmark's chat prompts, whose answers are unlike the training
    collection's), measured whole beside the held-out split at every point. ``labels``:
    "soft" learns the target's top-K distribution where the cache holds it (the greedy
    choice where it does not), "greedy" its first choice only."""
    if labels not in LABELS:
        raise ValueError(f"labels must be one of {LABELS}, not {labels!r}")
    soft = labels == "soft" and cache.top_ids is not None
    torch.manual_seed(0)
    head = EagleHead(cfg, embed, torch.from_numpy(draft_ids)).to(device)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    to_draft = draft_map(draft_ids, cfg.vocab)
    state: dict[str, Any] = {"step": 0, "elapsed": 0.0, "positions": 0, "timeline": []}
    ckpt = Path(work) / CHECKPOINT
    if ckpt.is_file():
        saved = torch.load(ckpt, map_location=device, weights_only=False)
        if list(saved["draft_ids"]) == draft_ids.tolist():
            head.load_state_dict(saved["head"], strict=False)
            opt.load_state_dict(saved["opt"])
            state = {"positions": 0, **saved["state"]}
            logger.info(
                "resuming from %s: step %d, %.1f minutes trained",
                ckpt,
                state["step"],
                state["elapsed"] / 60,
            )
        else:
            logger.warning(
                "the draft vocabulary changed with the training data: the head in %s does not "
                "fit it and training starts over",
                ckpt,
            )
    budget = max(minutes * 60.0, 1.0)
    eval_seconds = max(checkpoint_seconds, budget / TIMELINE_POINTS)
    probe = timeline_rows(cache, eval_rows)
    sets = {"heldout": (cache, probe)}
    sets |= {name: (c, list(range(c.num_sequences))) for name, c in (also or {}).items()}
    rng = np.random.default_rng(state["step"])
    pool = np.asarray(train_rows)
    warmup = 50
    seconds = int(budget)
    loop = Loop(
        seconds,
        "training the draft head",
        show=progress,
        initial=min(int(state["elapsed"]), seconds),
    )
    used = threads if device == "cpu" else torch.get_num_threads()
    if device == "cpu":
        used = torch_threads(threads, used)
        torch.set_num_threads(used)
    t_start = time.perf_counter() - state["elapsed"]
    last_ckpt = last_eval = time.perf_counter()
    loss = torch.zeros(())
    while True:
        elapsed = time.perf_counter() - t_start
        if elapsed >= budget or (max_steps and state["step"] >= max_steps):
            break
        # the cosine follows whichever bound comes first: a run of max_steps decays by steps
        frac = min(max(elapsed / budget, state["step"] / max_steps if max_steps else 0.0), 1.0)
        scale = min(1.0, (state["step"] + 1) / warmup) * (
            0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac))
        )
        for group in opt.param_groups:
            group["lr"] = lr * scale
        rows = rng.choice(pool, size=min(batch, len(pool)), replace=False)
        b = batch_tensors(cache, rows.tolist(), to_draft, soft=soft).to(device)
        loss = ttt_loss(head, b.features, b.next_ids, b.labels, depth, b.soft).loss
        if loss.requires_grad:
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        state["step"] += 1
        state["positions"] += int((b.labels >= 0).sum())
        now = time.perf_counter()
        state["elapsed"] = now - t_start
        loop.update(
            max(0, min(int(state["elapsed"]), seconds) - loop.done), note=f"loss {loss.item():.3f}"
        )
        if now - last_eval >= eval_seconds:
            _measure(head, state, sets, to_draft, depth, device, used)
            last_eval = time.perf_counter()
        if time.perf_counter() - last_ckpt >= checkpoint_seconds:
            _save(head, opt, state, draft_ids, ckpt)
            last_ckpt = time.perf_counter()
            if device == "cpu":
                used = torch_threads(threads, used)
                torch.set_num_threads(used)
        t_start += time.perf_counter() - now  # evaluation and saving are not training time
    loop.close()
    _measure(head, state, sets, to_draft, depth, device, used)
    _save(head, opt, state, draft_ids, ckpt)
    head.eval()
    report = {
        "steps": state["step"],
        "minutes": round(state["elapsed"] / 60, 2),
        "positions_trained": state["positions"],
        "positions_per_second": round(state["positions"] / max(state["elapsed"], 1e-9), 1),
        "depth": depth,
        "batch": batch,
        "lr": lr,
        "device": device,
        "threads": threads,
        "labels": f"soft (the target's top {cache.top_ids.shape[1]})"
        if soft and cache.top_ids is not None
        else "greedy (the target's choice)",
        "final_loss": round(float(loss.item()), 4),
        "heldout": acceptance(head, cache, eval_rows, to_draft, depth, device),
        **{name: state["timeline"][-1][name] for name in also or {}},
        "timeline_sequences": len(probe),
        "timeline": state["timeline"],
    }
    return head.cpu(), report


def _measure(
    head: EagleHead,
    state: dict[str, Any],
    sets: dict[str, tuple[FeatureCache, list[int]]],
    to_draft: np.ndarray,
    depth: int,
    device: str,
    threads: int,
) -> None:
    """Acceptance on each evaluation set now, appended to the timeline and logged."""
    if state["timeline"] and state["timeline"][-1]["step"] == state["step"]:
        return
    point: dict[str, Any] = {
        "step": state["step"],
        "minutes": round(state["elapsed"] / 60, 2),
        "positions_trained": state.get("positions", 0),
        "threads": threads,
    }
    for name, (cache, rows) in sets.items():
        point[name] = acceptance(head, cache, rows, to_draft, depth, device)
    state["timeline"].append(point)
    logger.info(
        "step %d, %.1f min (%d threads): %s",
        state["step"],
        state["elapsed"] / 60,
        threads,
        "; ".join(
            f"{name} acceptance per position {point[name]['acceptance_per_position']}, "
            f"{point[name]['expected_tokens_per_step']:.2f} tokens per step"
            for name in sets
        ),
    )


def _save(
    head: EagleHead,
    opt: torch.optim.Optimizer,
    state: dict[str, Any],
    draft_ids: np.ndarray,
    path: Path,
) -> None:
    """Save a resumable checkpoint (atomically)."""
    weights = {k: v for k, v in head.state_dict().items() if k != "embed"}
    tmp = path.with_suffix(".tmp")
    torch.save(
        {"head": weights, "opt": opt.state_dict(), "state": state, "draft_ids": draft_ids.tolist()},
        tmp,
    )
    os.replace(tmp, path)
