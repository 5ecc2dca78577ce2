"""What MTP heads are trained on and how they are measured, apart from the training loop.

`chain_loss` is the teacher-forced objective (cross-entropy on the next-but-k token plus KL to
the base model's distribution); `acceptance` replays the greedy chain the runtime runs (heads
feeding their own drafts) to give held-out acceptance per position; `frequent_tokens` and
`coverage` choose and check the draft vocabulary. `mtp_train` re-exports them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from specport.exporter.mtp_heads import MTPHeads


def chain_loss(
    heads: MTPHeads,
    base: Any,
    hidden: torch.Tensor,
    seqs: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Teacher-forced chain over all positions; hidden [b, T, H], seqs [b, T].

    ``valid`` [b, T] marks real tokens (an answer's positions after its end are padding); a
    target that is padding, or outside the heads' draft vocabulary, adds no loss. The teacher
    is the base model's distribution over the heads' vocabulary."""
    t_len = seqs.shape[1]
    prev = hidden[:, : t_len - 1]
    loss = hidden.new_zeros(())
    for k in range(heads.num_heads):
        n = t_len - k - 2  # positions t with a target token t+k+2 inside the sequence
        if n <= 0:
            break
        out, logits = heads.step(k, prev[:, :n], seqs[:, k + 1 : k + 1 + n])
        target = heads.draft_index(seqs[:, k + 2 : k + 2 + n])
        keep = target >= 0
        if valid is not None:
            keep = keep & valid[:, k + 2 : k + 2 + n]
        target = torch.where(keep, target, torch.full_like(target, -100))
        if not bool(keep.any()):
            prev = out
            continue
        teacher = heads.project(hidden[:, k + 1 : k + 1 + n])
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        rows = keep.reshape(-1)
        kl = F.kl_div(
            F.log_softmax(logits, -1).reshape(-1, logits.shape[-1])[rows],
            F.log_softmax(teacher, -1).reshape(-1, logits.shape[-1])[rows],
            log_target=True,
            reduction="batchmean",
        )
        loss = loss + ce + kl
        prev = out
    return loss / heads.num_heads


@torch.no_grad()
def acceptance(
    heads: MTPHeads, hidden: torch.Tensor, seqs: torch.Tensor, valid: torch.Tensor | None = None
) -> dict[str, Any]:
    """Greedy chain as at inference (heads feed their own drafts): acceptance per position,
    over the positions whose next target is a real token (``valid``)."""
    k_heads, t_len = heads.num_heads, seqs.shape[1]
    n = t_len - k_heads - 1
    if valid is None:
        valid = torch.ones_like(seqs, dtype=torch.bool)
    h, tok = hidden[:, :n], seqs[:, 1 : 1 + n]
    ok = []
    for k in range(k_heads):
        h, logits = heads.step(k, h, tok)
        tok = heads.to_vocab(logits.argmax(-1))
        ok.append((tok == seqs[:, k + 2 : k + 2 + n]) & valid[:, k + 2 : k + 2 + n])
    run = torch.cumprod(torch.stack(ok, -1).to(torch.int64), -1)  # [N, n, K]
    counted = valid[:, 2 : 2 + n]
    per_pos = (
        run[counted].float().mean(dim=0) if bool(counted.any()) else run[0, 0] * 0.0
    ).tolist()
    return {
        "acceptance_per_position": [round(p, 4) for p in per_pos],
        "mean_accepted_length": round(1 + sum(per_pos), 4),
    }


def frequent_tokens(
    seqs: torch.Tensor, valid: torch.Tensor | None, size: int, vocab: int
) -> torch.Tensor:
    """The ``size`` most frequent token ids of the training answers (ties: lower id first),
    sorted by id: the draft vocabulary. Tokens the answers never use cannot be learned as
    targets anyway."""
    tokens = seqs if valid is None else seqs[valid]
    counts = torch.bincount(tokens.flatten(), minlength=vocab)
    order = torch.argsort(counts, descending=True, stable=True)  # ties keep the lower id first
    return torch.sort(order[: min(size, vocab)]).values


def coverage(heads: MTPHeads, seqs: torch.Tensor, valid: torch.Tensor | None) -> float:
    """Share of the answers' tokens inside the heads' vocabulary (1.0 without a draft one)."""
    tokens = seqs if valid is None else seqs[valid]
    return round(float((heads.draft_index(tokens) >= 0).float().mean()), 4)
