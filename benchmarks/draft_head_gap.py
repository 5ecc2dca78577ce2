"""Where an EAGLE head's first drafts go wrong: by data split and by the target's confidence.

For a head trained with `specport train-draft ART --out OUT` (its checkpoint and feature
caches stay in `OUT.training`), prints the first draft's accuracy (the share of positions
where the head's draft is the target's greedy choice: the first position's acceptance) on

- training sequences (a sample of them),
- the held-out split (the collection's first 5%: the same templates, other subjects),
- the answers to the bench's chat prompts and to the other chat prompts,

each split into buckets of the target's own top-1 probability at that position (and the chat
sets also by kind of prompt: question, instruction, rewrite), beside a bigram and a trigram
table of the training answers (next input token -> the target's most
frequent choice after it). A head that is right where the target is sure on the training
sequences but not on chat has met its data's limits, not the target's entropy's. Usage:

    python benchmarks/draft_head_gap.py OUT
"""

from __future__ import annotations

import collections
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from specport.artifact import manifest as art
from specport.drafting import _embedding
from specport.exporter.eagle_head import EagleConfig, EagleHead
from specport.samples.chat_prompts import CHAT_PROMPTS, MORE_CHAT_PROMPTS
from specport.train.eagle_cache import FeatureCache, open_cache
from specport.train.eagle_objective import ttt_loss
from specport.train.eagle_train import CHECKPOINT, batch_tensors, draft_map

BUCKETS = ((0.0, 0.3), (0.3, 0.5), (0.5, 0.7), (0.7, 0.9), (0.9, 1.01))
TRAIN_SAMPLE = 96  # training sequences measured (every few, across the split)


def load_head(out: Path, work: Path) -> EagleHead:
    """The head in ``work``'s checkpoint, with the artifact's token embedding."""
    manifest = art.read_manifest(out)
    cfg = EagleConfig(**json.loads((out / art.MANIFEST_NAME).read_text())["eagle"]["config"])
    saved = torch.load(work / CHECKPOINT, map_location="cpu", weights_only=False)
    embed = torch.from_numpy(_embedding(out, manifest))
    head = EagleHead(cfg, embed, torch.tensor(saved["draft_ids"]))
    head.load_state_dict(saved["head"], strict=False)
    return head.eval()


@torch.no_grad()
def first_draft(
    head: EagleHead, cache: FeatureCache, rows: Sequence[int], to_draft: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(right, the target's top-1 probability) for every labelled position of ``rows``."""
    right, sure = [], []
    for i in range(0, len(rows), 8):
        b = batch_tensors(cache, rows[i : i + 8], to_draft, soft=True)
        res = ttt_loss(head, b.features, b.next_ids, b.labels, 1)
        mask = res.counted[0]
        assert b.soft is not None
        right.append(res.right[0][mask].numpy())
        sure.append(b.soft[1][..., 0][mask].numpy())
    return np.concatenate(right), np.concatenate(sure)


def transitions(cache: FeatureCache, rows: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(input token before, input token, the target's choice after it) at each labelled
    position, as ``batch_tensors`` lays them out."""
    for i in rows:
        _, tok, choices, p = cache.sequence(int(i))
        for t in range(max(p - 1, 0), len(tok) - 2):
            yield int(tok[t]), int(tok[t + 1]), int(choices[t + 1])


def ngram_accuracy(
    train: FeatureCache, train_rows: Sequence[int], cache: FeatureCache, rows: Sequence[int]
) -> tuple[float, float]:
    """Accuracy of a bigram and a trigram (backing off to the bigram) table of the training
    answers: the target's most frequent choice after the input token(s)."""
    bi: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    tri: dict[tuple[int, int], collections.Counter[int]] = collections.defaultdict(
        collections.Counter
    )
    for a, b, c in transitions(train, train_rows):
        bi[b][c] += 1
        tri[(a, b)][c] += 1
    n = hit_bi = hit_tri = 0
    for a, b, c in transitions(cache, rows):
        n += 1
        guess_bi = bi[b].most_common(1)[0][0] if bi[b] else -1
        guess_tri = tri[(a, b)].most_common(1)[0][0] if tri[(a, b)] else guess_bi
        hit_bi += guess_bi == c
        hit_tri += guess_tri == c
    return hit_bi / max(n, 1), hit_tri / max(n, 1)


def main(out: Path) -> None:
    work = out.with_name(out.name + ".training")
    head = load_head(out, work)
    to_draft = draft_map(head.draft_ids.numpy(), head.cfg.vocab)
    train = open_cache(work / "features")
    n = train.num_sequences
    n_eval = max(2, n // 20)  # the held-out split, as train-draft makes it
    train_rows = list(range(n_eval, n))
    splits = {
        "training (sample)": (train, train_rows[:: max(1, len(train_rows) // TRAIN_SAMPLE)]),
        "held-out": (train, list(range(n_eval))),
    }
    chat_sets = (
        ("chat", "chat_features", CHAT_PROMPTS),
        ("chat-more", "more_chat_features", MORE_CHAT_PROMPTS),
    )
    for name, folder, prompts in chat_sets:
        if (work / folder).is_dir():
            c = open_cache(work / folder)
            splits[name] = (c, list(range(c.num_sequences)))
            if c.num_sequences == len(prompts):  # the caches keep the prompts' order
                for kind in ("question", "instruction", "rewrite"):
                    rows = [i for i, p in enumerate(prompts) if p["kind"] == kind]
                    splits[f"{name}: {kind}s"] = (c, rows)
    header = " | ".join(f"p1 {lo:.1f}-{min(hi, 1.0):.1f}" for lo, hi in BUCKETS)
    print(
        f"| split | positions | first draft right | target's mean p1 | {header} | bigram | trigram |"
    )
    print("|---" * (6 + len(BUCKETS)) + "|")
    for name, (cache, rows) in splits.items():
        right, sure = first_draft(head, cache, rows, to_draft)
        cells = []
        for lo, hi in BUCKETS:
            inside = (sure >= lo) & (sure < hi)
            cells.append(
                f"{right[inside].mean():.2f} ({inside.mean():.0%})" if inside.any() else "–"
            )
        bi, tri = ngram_accuracy(train, train_rows, cache, rows)
        print(
            f"| {name} | {len(right)} | {right.mean():.3f} | {sure.mean():.2f} | "
            + " | ".join(cells)
            + f" | {bi:.3f} | {tri:.3f} |"
        )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
