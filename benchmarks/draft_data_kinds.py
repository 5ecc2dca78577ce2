"""A draft head's acceptance on held-apart real prompts against the kind and size of its data.

Two steps, sharing one work folder (the target's features for every set are computed once):

    python benchmarks/draft_data_kinds.py prepare ART WORK --train FILE \
        --heldout NAME=FILE [--heldout NAME=FILE ...] [--answers 512] [--texts 1024]
    python benchmarks/draft_data_kinds.py train WORK RUN --steps 600 \
        --use answers:512 [--use text:1024] [--use builtin:512]

``prepare`` stages ART with its feature output (as ``train-draft`` does), then builds feature
caches (``train.eagle_cache``) of: the first ``--texts`` examples of ``--train`` read as text
(prompt under the chat template + the file's written answer, prefill only:
``train.draft_data.text_sequences``); the model's own greedy answers (batched engine) to the
first ``--answers`` of the same prompts; its answers to as many prompts of the built-in
collection (``samples.chat_distill``, ``train-draft``'s data without ``--data``); and its
answers to each ``--heldout`` file and to the two built-in chat sets, the evaluation sets.
It prints the seconds each cache took (the data's cost per position, by kind).

``train`` trains a head from scratch for exactly ``--steps`` steps (``train_head``'s
``max_steps``; the cosine schedule then follows the steps) on the union of the first N
sequences of each ``--use KIND:N`` cache, and reports first-draft acceptance and expected
tokens per verify step (depth 4) on every evaluation set, from ``train_head``'s report, to
``WORK/RUN/report.json``. The draft vocabulary is chosen from the training rows, as
``train-draft`` does.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from specport.drafting import (
    _answers,
    _chat_caches,
    _embedding,
    _feature_dim,
    _prompts,
    _runner,
    _stage,
)
from specport.train.draft_data import end_of_turn, read_examples, text_sequences
from specport.train.eagle_cache import FeatureCache, build_cache, build_seconds, open_cache

NEW_TOKENS = 128


def _template(model: Any, path: Path) -> Any:
    from specport.core.chat_template import load_chat_template

    return load_chat_template(SimpleNamespace(tokenizer=model.tokenizer, path=path))


def _cache_from_answers(work: Path, model: Any, name: str, prompts: list[list[int]]) -> None:
    t0 = time.perf_counter()
    answers, seconds = _answers(work, model, prompts, NEW_TOKENS, f"{name}_answers.json")
    seqs = [p + a for p, a in zip(prompts, answers)]
    build_cache(
        work / name, seqs, [len(p) for p in prompts], _feature_dim(model), _runner(model), None
    )
    _record(work, name, seqs, [len(p) for p in prompts], seconds, time.perf_counter() - t0)


def _record(
    work: Path, name: str, seqs: list[list[int]], starts: list[int], answer_s: Any, wall: float
) -> None:
    learned = sum(len(s) - max(p - 1, 0) - 1 for s, p in zip(seqs, starts))
    rec = {
        "sequences": len(seqs),
        "learned_positions": learned,
        "answers_seconds": answer_s,
        "features_seconds": build_seconds(work / name),
        "wall_seconds": round(wall, 1),
    }
    print(f"{name}: {json.dumps(rec)}", flush=True)
    path = work / "costs.json"
    costs = json.loads(path.read_text()) if path.is_file() else {}
    costs[name] = rec
    path.write_text(json.dumps(costs, indent=1))


def prepare(args: argparse.Namespace) -> None:
    from specport.artifact import manifest as art
    from specport.loading import load

    src, work = Path(args.artifact), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    staged = work / "artifact"
    if not (staged / art.MANIFEST_NAME).is_file():
        _stage(src, staged, art.read_manifest(src))
    model = load(staged, threads=args.threads)
    template = _template(model, src)
    render = lambda text: template.render_ids([{"role": "user", "content": text}])  # noqa: E731
    for spec in args.heldout:
        name, file = spec.split("=", 1)
        prompts = [render(e.prompt) for e in read_examples(file)]
        _cache_from_answers(work, model, f"eval_{name}", prompts)
    _chat_caches(src, model, work, NEW_TOKENS, _feature_dim(model), None)
    examples = read_examples(args.train)
    t0 = time.perf_counter()
    end = end_of_turn(template, model.encode)
    seqs, starts = text_sequences(examples[: args.texts], render, model.encode, NEW_TOKENS, end)
    build_cache(work / "text", seqs, starts, _feature_dim(model), _runner(model), None)
    _record(work, "text", seqs, starts, None, time.perf_counter() - t0)
    real = [render(e.prompt) for e in examples[: args.answers]]
    _cache_from_answers(work, model, "answers", real)
    builtin = _prompts(src, model, None, args.answers, "builtin", work)
    _cache_from_answers(work, model, "builtin", builtin)


def concat(parts: list[tuple[FeatureCache, int]]) -> FeatureCache:
    """The first n sequences of each cache, as one cache in memory."""
    feats, toks, choices, ids, probs, prompts, lengths = [], [], [], [], [], [], []
    for cache, n in parts:
        n = min(n, cache.num_sequences)
        end = int(cache.offsets[n])
        feats.append(np.asarray(cache.features[:end]))
        toks.append(cache.tokens[:end])
        choices.append(cache.choices[:end])
        assert cache.top_ids is not None and cache.top_probs is not None
        ids.append(np.asarray(cache.top_ids[:end]))
        probs.append(np.asarray(cache.top_probs[:end]))
        prompts.append(cache.prompts[:n])
        lengths.append(np.diff(cache.offsets[: n + 1]))
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64)
    return FeatureCache(
        np.concatenate(feats),
        np.concatenate(toks),
        np.concatenate(choices),
        offsets,
        np.concatenate(prompts),
        np.concatenate(ids),
        np.concatenate(probs),
    )


def train(args: argparse.Namespace) -> None:
    import torch

    from specport.artifact import manifest as art
    from specport.drafting import AUTO_DRAFT_VOCAB, head_config
    from specport.train.eagle_cache import frequent_choices
    from specport.train.eagle_train import train_head

    work = Path(args.work)
    run = work / args.run
    run.mkdir(parents=True, exist_ok=True)
    (run / "checkpoint.pt").unlink(missing_ok=True)  # from scratch, always
    parts = []
    for use in args.use:
        kind, n = use.split(":")
        parts.append((open_cache(work / kind), int(n)))
    heldout = sorted(p.name for p in work.glob("eval_*") if p.is_dir())
    evals = {p: open_cache(work / p) for p in heldout}
    first = evals.pop(heldout[0])  # the "heldout" line of the report
    cache = concat([*parts, (first, first.num_sequences)])
    n_train = cache.num_sequences - first.num_sequences
    train_rows, eval_rows = list(range(n_train)), list(range(n_train, cache.num_sequences))
    for folder, name in (("chat_features", "chat_prompts"), ("more_chat_features", "more_chat")):
        if (work / folder).is_dir():
            evals[name] = open_cache(work / folder)
    manifest = art.read_manifest(work / "artifact", check_hashes=False)
    vocab = int(manifest.config["vocab_size"])
    ids = frequent_choices(cache, train_rows, min(AUTO_DRAFT_VOCAB, vocab), vocab)
    cfg = head_config(manifest, len(ids))
    embed = torch.from_numpy(_embedding(work / "artifact", manifest))
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    _, report = train_head(
        cache,
        cfg,
        embed,
        ids,
        train_rows,
        eval_rows,
        run,
        minutes=args.minutes,
        max_steps=args.steps,
        threads=args.threads,
        also=evals,
        progress=False,
    )
    wall = time.perf_counter() - t0
    summary = {
        "use": args.use,
        "steps": report.get("steps"),
        "train_sequences": n_train,
        "wall_seconds": round(wall, 1),
        "load_at_end": Path("/proc/loadavg").read_text().split()[:3],
        heldout[0]: _short(report["heldout"]),
    }
    for name in evals:
        summary[name] = _short(report[name])
    (run / "report.json").write_text(json.dumps({"summary": summary, "report": report}, indent=1))
    print(json.dumps(summary), flush=True)


def _short(r: dict[str, Any]) -> dict[str, Any]:
    return {
        "first": r["acceptance_per_position"][0],
        "per_position": r["acceptance_per_position"],
        "tokens_per_step": r["expected_tokens_per_step"],
        "positions": r["positions"],
    }


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("artifact")
    a.add_argument("work")
    a.add_argument("--train", required=True)
    a.add_argument("--heldout", action="append", default=[])
    a.add_argument("--answers", type=int, default=512)
    a.add_argument("--texts", type=int, default=1024)
    a.add_argument("--threads", type=int, default=2)
    t = sub.add_parser("train")
    t.add_argument("work")
    t.add_argument("run")
    t.add_argument("--use", action="append", required=True)
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--minutes", type=float, default=60.0)
    t.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    prepare(args) if args.cmd == "prepare" else train(args)


if __name__ == "__main__":
    main(sys.argv[1:])
