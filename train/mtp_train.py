"""Train MTP heads by self-distillation and write an artifact whose graph carries the MTP branch.

Self-distillation: the frozen base model writes its own training data (greedy continuations
of story openings from ``--data``), so the heads learn exactly the distribution they will be
asked to predict at inference (greedy speculative decoding accepts a draft only if it equals
the base model's argmax). Head k at position t sees the base hidden state h_t (chained through
heads 1..k-1) and token t+k, and is trained on token t+k+1 (cross-entropy) and on the base
model's distribution for that token (KL). Hidden states are computed once up front; a step
then only runs the small heads.

DeepSeek-V3 artifacts that carry real MTP weights (``mtp_source.safetensors``) skip training
and use them as they are. The objective and the held-out acceptance live in `mtp_objective`,
writing the artifact in `mtp_artifact`; this module loads the base, trains and ties them up.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specport.artifact import manifest as art
from specport.core.errors import InputError, UsageError
from specport.core.progress import Loop, Stages
from specport.core.tokenizer import load_tokenizer
from specport.exporter import source as src_mod
from specport.exporter.mtp_artifact import write_mtp_artifact
from specport.exporter.mtp_heads import MTPHeads
from specport.exporter.mtp_weights import load_deepseek_mtp
from specport.train.mtp_data import (
    base_hidden,
    chat_prompts,
    read_prompts,
    self_generate,
    self_generate_chat,
)
from specport.train.mtp_objective import acceptance, chain_loss, coverage, frequent_tokens

logger = logging.getLogger(__name__)


def load_base(manifest: art.Manifest) -> Any:
    """The frozen torch base model the artifact was exported from (``source.path``)."""

    path = manifest.source.get("path")
    if not path:
        raise InputError(
            "the artifact's manifest has no source.path; re-export it with specport export."
        )
    source = src_mod.resolve(path)
    model = src_mod.load_model(source, num_layers=manifest.source.get("layers_kept"))
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def train_heads(
    base: Any,
    seqs: torch.Tensor,  # [N, T] self-generated token ids
    num_heads: int,
    steps: int,
    batch: int = 32,
    lr: float = 3e-3,
    progress: bool | None = None,
    hidden: torch.Tensor | None = None,  # [N, T, H] when computed with the sequences (chat)
    window: int = 0,
    valid: torch.Tensor | None = None,  # [N, T] real tokens (answers end at different lengths)
    draft_vocab: int = 0,
) -> tuple[MTPHeads, dict[str, Any]]:
    """Heads trained on ``seqs``; ``window`` > 0 trains each step on one random ``window``-token
    slice of the sampled sequences instead of all positions. The loss is dominated by the LM
    head (positions x hidden x vocab, per head, forward and backward), so on a large vocabulary
    a window buys many more optimizer steps for the same time, and a ``draft_vocab`` (the
    answers' most frequent tokens; 0 = the full vocabulary) shrinks that head for training and
    inference alike."""
    torch.manual_seed(0)
    if hidden is None:
        hidden = base_hidden(base, seqs)
    n_eval = max(8, len(seqs) // 10)
    train_h, train_s, eval_h, eval_s = (
        hidden[n_eval:],
        seqs[n_eval:],
        hidden[:n_eval],
        seqs[:n_eval],
    )
    train_v = eval_v = None
    if valid is not None:
        train_v, eval_v = valid[n_eval:], valid[:n_eval]
    vocab = int(base.get_output_embeddings().weight.shape[0])
    ids = None
    if 0 < draft_vocab < vocab:
        ids = frequent_tokens(train_s, train_v, draft_vocab, vocab)
    heads = MTPHeads(base, num_heads, draft_vocab=ids)
    heads.train()
    params = list(heads.parameters())  # heads only: embedding and LM head stay frozen
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
        ),
    )
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    # A bar on a terminal; a line per tenth (elapsed, ETA, loss) in logs and CI output.
    loop = Loop(steps, "training MTP heads", show=progress)
    for _step in range(steps):
        idx = torch.randint(0, len(train_s), (batch,), generator=gen)
        step_h, step_s = train_h[idx], train_s[idx]
        step_v = None if train_v is None else train_v[idx]
        if 0 < window < step_s.shape[1]:
            start = int(torch.randint(0, step_s.shape[1] - window + 1, (1,), generator=gen))
            step_h, step_s = step_h[:, start : start + window], step_s[:, start : start + window]
            if step_v is not None:
                step_v = step_v[:, start : start + window]
        loss = chain_loss(heads, base, step_h, step_s, step_v)
        if not loss.requires_grad:  # the slice fell past the end of every sampled answer
            loop.update(note="(no targets)")
            continue
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        loop.update(note=f"loss {loss.item():.3f}")
    loop.close()
    heads.eval()
    report: dict[str, Any] = {
        "steps": steps,
        "window": window or None,
        "batch": batch,
        "seconds": round(time.perf_counter() - t0, 1),
        "final_loss": round(float(loss), 4),
        "draft_vocab": heads.draft_size,
        "heldout_coverage": coverage(heads, eval_s, eval_v),
    }
    report["heldout"] = acceptance(heads, eval_h, eval_s, eval_v)
    return heads, report


AUTO_DRAFT_VOCAB = 8192


def auto_draft_vocab(vocab: int) -> int:
    """The default draft vocabulary: 8192 tokens on vocabularies over twice that, else all.

    Measured on SmolLM2-135M (49,152 tokens, fp32, 2 threads): 3 heads over the full
    vocabulary made a decode step 1.47x slower (each head re-reads the 113 MB LM head); over
    8192 rows (19 MB, inside the 32 MB last-level cache) about 1.1x, with 96.7% of held-out
    answer tokens inside the subset and a higher held-out acceptance."""
    return AUTO_DRAFT_VOCAB if vocab > 2 * AUTO_DRAFT_VOCAB else 0


def train_mtp(
    artifact: str | os.PathLike[str],
    out: str | os.PathLike[str],
    num_heads: int = 3,
    data: str | Path | None = None,
    steps: int = 600,
    num_sequences: int = 768,
    prompt_len: int = 8,
    new_tokens: int = 120,
    progress: bool | None = None,
    threads: int = 1,
    batch: int = 32,
    chat: bool = False,
    window: int = 0,
    draft_vocab: int | None = None,
    load_model: Callable[..., Any] | None = None,
) -> art.Manifest:
    """Heads for ``artifact`` (trained, or the checkpoint's own for DeepSeek-V3) -> artifact ``out``.

    ``load_model(artifact, threads=...)`` loads the artifact for generation (`specport.load`);
    ``chat`` needs it to decode the chat answers with onnxruntime. It is a parameter because
    training sits below the API that loads models (`specport.build.train_mtp` passes it).

    ``draft_vocab`` > 0 lets the heads score only that many of the answers' most frequent
    tokens (see `MTPHeads.set_draft_vocab`); 0 scores the whole vocabulary; None (default)
    picks `auto_draft_vocab`."""

    artifact = Path(artifact)
    manifest = art.read_manifest(artifact)
    if draft_vocab is None:
        draft_vocab = auto_draft_vocab(int(manifest.vocab_size or 0))
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))  # small models: more threads mostly spin under load
    try:
        return _train_mtp(
            artifact,
            manifest,
            Path(out),
            num_heads,
            data,
            steps,
            num_sequences,
            prompt_len,
            new_tokens,
            progress,
            batch,
            chat,
            window,
            draft_vocab,
            threads,
            load_model,
        )
    finally:
        torch.set_num_threads(saved_threads)


def _train_mtp(
    artifact: Path,
    manifest: art.Manifest,
    out: Path,
    num_heads: int,
    data: str | Path | None,
    steps: int,
    num_sequences: int,
    prompt_len: int,
    new_tokens: int,
    progress: bool | None,
    batch: int = 32,
    chat: bool = False,
    window: int = 0,
    draft_vocab: int = 0,
    threads: int = 1,
    load_model: Callable[..., Any] | None = None,
) -> art.Manifest:
    stages = Stages(total=3, show=progress)
    stages.start("loading the PyTorch base model")
    base = load_base(manifest)
    real = manifest.extra.get("mtp_source_weights")
    if real:
        from safetensors.torch import load_file

        heads = load_deepseek_mtp(base, load_file(str(artifact / real["file"])))
        report: dict[str, Any] = {"source": "checkpoint", "heads": heads.num_heads}
        logger.info("using the checkpoint's %d MTP layer(s); no training", heads.num_heads)
    else:
        if data is None:
            raise InputError(
                "--data FILE is required to train MTP heads (text, documents separated by blank lines)."
            )
        tokenizer = load_tokenizer(artifact, manifest.tokenizer)
        if tokenizer is None:
            raise InputError(f"{artifact} has no tokenizer; train-mtp needs one to read --data.")
        stages.start("self-generating text and training the heads")
        t0 = time.perf_counter()
        hidden = valid = None
        if chat:
            if load_model is None:
                raise UsageError(
                    "chat=True needs load_model (e.g. specport.load) to decode answers"
                )
            turns = chat_prompts(Path(data), artifact, tokenizer, num_sequences)
            seqs, hidden, valid = self_generate_chat(
                load_model(artifact, threads=threads), base, turns, new_tokens
            )
        else:
            prompts = read_prompts(Path(data), tokenizer, prompt_len, num_sequences)
            seqs = self_generate(base, prompts, new_tokens)
        logger.info(
            "self-generated %s tokens in %.1fs", tuple(seqs.shape), time.perf_counter() - t0
        )
        heads, report = train_heads(
            base,
            seqs,
            num_heads,
            steps,
            batch=batch,
            progress=progress,
            hidden=hidden,
            window=window,
            valid=valid,
            draft_vocab=draft_vocab,
        )
        report = {
            "source": "self-distillation" + (" (chat answers)" if chat else ""),
            "data": str(data),
            "sequences": list(seqs.shape),
            **report,
        }
    stages.start("writing the MTP artifact")
    manifest = write_mtp_artifact(artifact, heads, out, report)
    stages.done()
    return manifest
