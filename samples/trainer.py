"""Train the tiny demo `LlamaForCausalLM` (and its tokenizer) on the synthetic corpus, on CPU.

The demo has to be built on the user's machine (no download), so training is bounded by a wall
clock budget as well as a step budget, whichever ends first; the learning-rate schedule follows
the larger of the two progress fractions so a slow machine still finishes its cosine decay.
The tokenizer is a SentencePiece-style BPE with byte fallback (same layout as Llama / stories260K),
so the demo goes through exactly the tokenizer code path real Llama models use.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from specport.core.corpus import generate_corpus
from specport.core.progress import Loop, bar_enabled
from specport.exporter.sp_tokenizer import (
    BOS,
    EOS,
    SPACE,
    UNK,
    build_sp_bpe_tokenizer,
    byte_pieces,
    llama_tokenizer_config,
    save_tokenizer,
)

logger = logging.getLogger(__name__)

# transformers 5 moves rope_theta into rope_parameters but still accepts it as a keyword.
_ROPE: dict[str, Any] = {"rope_theta": 10000.0}

PAD = "<pad>"
SPECIAL_PIECES = [UNK, BOS, EOS, PAD]  # ids 0, 1, 2, 3


@dataclass(frozen=True)
class DemoTrainConfig:
    """Sizes and budgets of the demo model; defaults train in ~90 s on 2 CPU cores."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    context_length: int = 256
    vocab_size: int = 512
    n_docs: int = 20_000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    warmup_steps: int = 20
    max_steps: int = 500  # loss plateaus near 0.78 after ~300 steps
    min_steps: int = 200
    time_budget_s: float = 90.0
    seed: int = 0
    threads: int | None = None  # None: 2, or 1 when the machine is already busy


@dataclass(frozen=True)
class TrainResult:
    """What a training run did; `final_loss` is a smoothed training cross-entropy (nats/token)."""

    steps: int
    final_loss: float
    seconds: float
    tokens_seen: int


def train_tokenizer(texts: list[str], vocab_size: int = 512) -> Tokenizer:
    """Train a SentencePiece-style BPE tokenizer: specials, 256 byte pieces, then learned pieces."""
    n_learned = vocab_size - len(SPECIAL_PIECES) - 256
    if n_learned < 64:
        raise ValueError(f"vocab_size {vocab_size} leaves too few learned pieces ({n_learned})")
    bpe = Tokenizer(models.BPE())
    # Training splits at spaces and punctuation, so pieces never span two words ("▁Max." would
    # waste a slot next to "▁Max"); the Llama-style tokenizer built from the merges then needs no
    # splitting of its own, because no merge crosses those boundaries.
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=True),
            pre_tokenizers.Punctuation(behavior="isolated"),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=n_learned, show_progress=False, special_tokens=[])
    bpe.train_from_iterator(texts, trainer=trainer)
    learned = sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])
    pieces = SPECIAL_PIECES + byte_pieces() + [p for p, _ in learned]
    raw_merges = json.loads(bpe.to_str())["model"]["merges"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in raw_merges]
    return build_sp_bpe_tokenizer(pieces, merges=merges, special=SPECIAL_PIECES)


def model_config(cfg: DemoTrainConfig, tok: Tokenizer) -> LlamaConfig:
    vocab = tok.get_vocab()
    return LlamaConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        vocab_size=tok.get_vocab_size(),
        max_position_embeddings=cfg.context_length,
        rms_norm_eps=1e-5,
        **_ROPE,
        tie_word_embeddings=True,
        bos_token_id=vocab[BOS],
        eos_token_id=vocab[EOS],
        pad_token_id=vocab[PAD],
        dtype="float32",
    )


def _token_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents as one id stream, each `<s> story </s>`. Returns [N] int64."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    assert bos is not None and eos is not None, "the demo tokenizer always has <s> and </s>"
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(bos)
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def _auto_threads(preferred: int = 2) -> int:
    """2 threads on an idle machine, 1 when other processes already keep the cores busy.

    Two OpenMP threads that share cores with other work spin at every barrier: measured on a busy
    2-core machine, a step took 7x longer with 2 threads than with 1.
    """
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    free = int(cores - load + 0.5)
    threads = max(1, min(preferred, cores, free))
    logger.debug("training threads: %d (cores %d, load %.1f)", threads, cores, load)
    return threads


def _planned_steps(cfg: DemoTrainConfig, step: int, elapsed: float, train_elapsed: float) -> int:
    """How many steps fit the time budget at the rate measured so far, within [min, max] steps.

    `min_steps` wins over the time budget: on a busy machine a demo model that stopped early
    would only print one repeated token, which is worse than taking longer.
    """
    per_step = train_elapsed / max(step, 1)
    fit = step + int(max(cfg.time_budget_s - elapsed, 0.0) / max(per_step, 1e-9))
    return max(min(fit, cfg.max_steps), min(cfg.min_steps, cfg.max_steps))


def _lr(cfg: DemoTrainConfig, step: int, progress: float) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def train_demo_model(
    cfg: DemoTrainConfig | None = None, progress: bool | None = True
) -> tuple[LlamaForCausalLM, Tokenizer, TrainResult]:
    """Train tokenizer and model from scratch; stops at `max_steps` or `time_budget_s`."""
    cfg = cfg or DemoTrainConfig()
    start = time.perf_counter()
    texts = generate_corpus(cfg.n_docs, seed=cfg.seed)
    tok = train_tokenizer(texts, cfg.vocab_size)
    stream = _token_stream(tok, texts)
    logger.info("demo corpus: %d stories, %d tokens", len(texts), stream.numel())

    prev_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or _auto_threads())
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    model = LlamaForCausalLM(model_config(cfg, tok))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    seq = min(cfg.seq_len, cfg.context_length)
    # A bar on a terminal; a line per tenth (elapsed, ETA, loss) in logs and CI output.
    bar = Loop(cfg.max_steps, "training the demo model", show=progress)
    smoothed = float("nan")
    step = 0
    total = cfg.max_steps
    train_start = time.perf_counter()
    try:
        while step < total:
            elapsed = time.perf_counter() - start
            if step >= cfg.warmup_steps:
                total = _planned_steps(cfg, step, elapsed, time.perf_counter() - train_start)
                if step >= total:
                    break
                if bar.total != total:
                    bar.set_total(total)
            for group in opt.param_groups:
                group["lr"] = _lr(cfg, step, step / total)
            starts = torch.randint(0, stream.numel() - seq - 1, (cfg.batch_size,), generator=gen)
            batch = torch.stack([stream[s : s + seq + 1] for s in starts.tolist()])  # [B, S+1]
            logits = model(input_ids=batch[:, :-1]).logits  # [B, S, V]
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            value = loss.item()
            smoothed = value if math.isnan(smoothed) else 0.9 * smoothed + 0.1 * value
            step += 1
            bar.update(1, note=f"loss {smoothed:.3f}")
            if step % 50 == 0:
                logger.debug("step %d/%d loss %.3f", step, total, smoothed)
    finally:
        bar.close()
        torch.set_num_threads(prev_threads)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
    )
    result = TrainResult(step, smoothed, time.perf_counter() - start, step * cfg.batch_size * seq)
    logger.info(
        "demo model: %d steps in %.1f s (%.1f s training), loss %.3f",
        step,
        result.seconds,
        time.perf_counter() - train_start,
        smoothed,
    )
    return model, tok, result


def save_hf_model_dir(model: LlamaForCausalLM, tok: Tokenizer, out_dir: Path) -> Path:
    """Write `model` and `tok` as a regular Hugging Face directory (safetensors weights)."""
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not bar_enabled():  # transformers' "Writing model shards" bar: terminals only
        transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(tok, llama_tokenizer_config(tok, model.config.max_position_embeddings), out_dir)
    return out_dir
