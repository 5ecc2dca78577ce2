"""Train an EAGLE draft head on a feature cache for a bounded time, resumably.

The head (``eagle_head``) learns the target's own greedy choices from the target's features
(``eagle_cache``), with the training-time test over ``depth`` chained drafts. Training stops
after ``minutes`` of wall time (the time already spent before a resume counts), saves a
checkpoint about every minute (``checkpoint.pt`` beside the cache: a rerun of the same command
continues from it) and measures the held-apart sequences' acceptance per draft position at
each checkpoint, so one run also reports acceptance against training time.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specport.exporter.eagle_cache import FeatureCache
from specport.exporter.eagle_head import EagleConfig, EagleHead
from specport.progress import Loop

logger = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"


def batch_tensors(
    cache: FeatureCache, rows: Sequence[int], to_draft: np.ndarray, window: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(features [B, T, 3H], next ids [B, T], labels [B, T]) for sequences ``rows``.

    Position t's input token is the one at t+1 and its label the target's choice after t+1
    (the token at t+2) as a draft-vocabulary index: -2 where the target chose a token outside
    it, -1 where there is nothing to learn (padding). Each sequence starts at the prompt's
    second-to-last token, the first position whose features a decoding loop shows the head;
    ``window`` > 0 keeps at most the last ``window`` positions."""
    parts = []
    for i in rows:
        f, tok, ch, p = cache.sequence(int(i))
        t = len(tok) - 1
        lab = to_draft[ch[1:]]
        lab[: max(p - 2, 0)] = -1
        # the runtime shows the head the prompt's features from its last fed token on (a
        # shared-layout prefill selects one position): train with the same context
        start = max(p - 2, 0, t - window if window else 0)
        parts.append((np.asarray(f[start:t], np.float32), tok[start + 1 :], lab[start:]))
    width = max(len(p[1]) for p in parts)
    dim = parts[0][0].shape[-1]
    feats = np.zeros((len(parts), width, dim), np.float32)
    ids = np.zeros((len(parts), width), np.int64)
    labels = np.full((len(parts), width), -1, np.int64)
    for b, (f, tok, lab) in enumerate(parts):
        feats[b, : len(tok)] = f
        ids[b, : len(tok)] = tok
        labels[b, : len(tok)] = lab
    return torch.from_numpy(feats), torch.from_numpy(ids), torch.from_numpy(labels)


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
    """Greedy acceptance on ``rows``: the rate at each draft position given the earlier drafts
    were accepted, and the tokens a verify step then yields on average (1 + accepted drafts)."""
    head.eval()
    hits = np.zeros(depth, np.int64)
    seen = np.zeros(depth, np.int64)
    for i in range(0, len(rows), batch):
        f, ids, lab = batch_tensors(cache, rows[i : i + batch], to_draft)
        _, stats = head.ttt_loss(f.to(device), ids.to(device), lab.to(device), depth)
        for j, (c, n) in enumerate(stats):
            hits[j] += c
            seen[j] += n
    head.train()
    rates = [float(h) / max(int(s), 1) for h, s in zip(hits, seen)]
    expected = 1.0 + sum(float(np.prod(rates[: k + 1])) for k in range(depth))
    return {
        "acceptance_per_position": [round(r, 4) for r in rates],
        "expected_tokens_per_step": round(expected, 3),
        "positions": int(seen[0]),
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
    max_steps: int = 0,  # > 0: stop after this many steps as well (tests)
) -> tuple[EagleHead, dict[str, Any]]:
    """The head trained for ``minutes`` (resuming ``work/checkpoint.pt`` if there is one).

    Small batches (2 whole sequences, ~300 positions x ``depth``): on 2 CPU cores a step of 8
    sequences took 12 s (SmolLM2: the 8k-row LM head and the 1536-wide MLP at every position
    and depth), so a 20-minute budget made only ~100 updates; 2 sequences give 4x the updates
    for the same positions seen."""
    torch.manual_seed(0)
    head = EagleHead(cfg, embed, torch.from_numpy(draft_ids)).to(device)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    to_draft = draft_map(draft_ids, cfg.vocab)
    state: dict[str, Any] = {"step": 0, "elapsed": 0.0, "timeline": []}
    ckpt = Path(work) / CHECKPOINT
    if ckpt.is_file():
        saved = torch.load(ckpt, map_location=device, weights_only=False)
        if list(saved["draft_ids"]) == draft_ids.tolist():
            head.load_state_dict(saved["head"], strict=False)
            opt.load_state_dict(saved["opt"])
            state = saved["state"]
            logger.info(
                "resuming from %s: step %d, %.1f minutes trained",
                ckpt,
                state["step"],
                state["elapsed"] / 60,
            )
    budget = max(minutes * 60.0, 1.0)
    rng = np.random.default_rng(state["step"])
    pool = np.asarray(train_rows)
    warmup = 50
    seconds = int(budget)
    loop = Loop(seconds, "training the draft head", show=progress)
    loop.update(min(int(state["elapsed"]), seconds))
    t_start = time.perf_counter() - state["elapsed"]
    last_ckpt = time.perf_counter()
    loss = torch.zeros(())
    while True:
        elapsed = time.perf_counter() - t_start
        if elapsed >= budget or (max_steps and state["step"] >= max_steps):
            break
        frac = min(elapsed / budget, 1.0)
        scale = min(1.0, (state["step"] + 1) / warmup) * (
            0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac))
        )
        for group in opt.param_groups:
            group["lr"] = lr * scale
        rows = rng.choice(pool, size=min(batch, len(pool)), replace=False)
        f, ids, lab = batch_tensors(cache, rows.tolist(), to_draft, window=0)
        loss, _ = head.ttt_loss(f.to(device), ids.to(device), lab.to(device), depth)
        if loss.requires_grad:
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        state["step"] += 1
        now = time.perf_counter()
        state["elapsed"] = now - t_start
        loop.update(
            max(0, min(int(state["elapsed"]), seconds) - loop.done), note=f"loss {loss.item():.3f}"
        )
        if now - last_ckpt >= checkpoint_seconds:
            _checkpoint(
                head, opt, state, draft_ids, cache, eval_rows, to_draft, depth, device, ckpt
            )
            last_ckpt = time.perf_counter()
            t_start += last_ckpt - now  # evaluation time is not training time
    loop.close()
    _checkpoint(head, opt, state, draft_ids, cache, eval_rows, to_draft, depth, device, ckpt)
    head.eval()
    report = {
        "steps": state["step"],
        "minutes": round(state["elapsed"] / 60, 2),
        "depth": depth,
        "batch": batch,
        "lr": lr,
        "device": device,
        "final_loss": round(float(loss), 4),
        "heldout": state["timeline"][-1]["heldout"],
        "timeline": state["timeline"],
    }
    return head.cpu(), report


def _checkpoint(
    head: EagleHead,
    opt: torch.optim.Optimizer,
    state: dict[str, Any],
    draft_ids: np.ndarray,
    cache: FeatureCache,
    eval_rows: Sequence[int],
    to_draft: np.ndarray,
    depth: int,
    device: str,
    path: Path,
) -> None:
    """Measure held-out acceptance, log it, and save a resumable checkpoint (atomically)."""
    held = acceptance(head, cache, eval_rows, to_draft, depth, device)
    point = {"step": state["step"], "minutes": round(state["elapsed"] / 60, 2), "heldout": held}
    if not state["timeline"] or state["timeline"][-1]["step"] != state["step"]:
        state["timeline"].append(point)
    logger.info(
        "step %d, %.1f min: held-out acceptance per position %s, %.2f tokens per step",
        state["step"],
        state["elapsed"] / 60,
        held["acceptance_per_position"],
        held["expected_tokens_per_step"],
    )
    weights = {k: v for k, v in head.state_dict().items() if k != "embed"}
    tmp = path.with_suffix(".tmp")
    torch.save(
        {"head": weights, "opt": opt.state_dict(), "state": state, "draft_ids": draft_ids.tolist()},
        tmp,
    )
    os.replace(tmp, path)
