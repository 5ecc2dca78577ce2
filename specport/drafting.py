"""`specport.train_draft`: give an artifact an EAGLE-3-class draft head, trained on itself.

The steps, each resumable (the training folder ``OUT.training`` keeps what is done):

1. the target graph gets its ``eagle_features`` output (``passes.eagle_features``), written
   as a copy of the artifact in the training folder; the logits are checked unchanged;
2. the model answers a prompt collection (``--data``, a prompt file; default: 120 real
   human-written requests shipped with specport, ``samples.instructions``), greedily, with
   onnxruntime;
3. each prompt + answer runs through the target once; features, tokens and the target's
   choices go to a memory-mapped cache (``train.eagle_cache``);
4. the head trains for ``minutes`` (``train.eagle_train``), with checkpoints and held-out
   acceptance per draft position;
5. the draft graph and the manifest's ``eagle`` entry complete the copy, renamed to ``OUT``.

The answers, the feature cache and the last checkpoint stay in ``OUT.training`` (beside the
artifact, not in it: the artifact holds what its manifest lists and hashes), so the same
command with a larger ``minutes`` continues training the head of an existing ``OUT`` without
recomputing the data (``keep_data=False`` or ``rm -r OUT.training`` frees the disk; for
SmolLM2-135M's 2,048 answers it is about 1.2 GB). The input artifact is never written to; an
existing ``OUT`` is only ever the result of an earlier run on the same input, whose draft graph
and manifest a longer run replaces.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from specport.artifact import manifest as art
from specport.core.contract import EAGLE_FEATURES
from specport.core.errors import InputError, OutputError, UsageError
from specport.core.progress import Stages
from specport.train.draft_data import KINDS as DATA_KINDS

logger = logging.getLogger(__name__)

DEFAULT_SEQUENCES = 2048  # 768 learned the collection's templates, not chat (docs: Measured)
AUTO_DRAFT_VOCAB = 8192
# what the model answers without --data: the real requests shipped with specport
# (samples.instructions), the built-in templated collection, requests it writes itself, or half
# of the last two. The real requests: the model's answers to real prompts drafted better on
# held-apart real prompts than its answers to the templated collection
# (docs/benchmarks/2026-12-05-drafter-data.md)
MESSAGES = ("instructions", "builtin", "self", "mixed")
DEFAULT_MESSAGES = "instructions"
RUN_FILE = "run.json"  # in the training folder: the input this data belongs to
# with --data: the model's own answers to its prompts, its written answers read by prefill, or
# both. Answers: on held-apart real prompts they beat the written text and the mixture at equal
# size and steps (docs/benchmarks/2026-12-05-drafter-data.md)
DEFAULT_DATA_KIND = "answers"
MIXED_ANSWERED = 0.5  # --data-kind mixed: the share of the prompts the model also answers
MIN_PROMPT = 8  # tokens of a prompt that must fit before the answer (the chat header and more)


def train_draft(
    artifact: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    data: str | os.PathLike[str] | None = None,
    minutes: float = 10.0,
    device: str = "cpu",
    sequences: int = DEFAULT_SEQUENCES,
    new_tokens: int = 128,
    draft_vocab: int | None = None,
    depth: int = 4,
    threads: int = 2,
    progress: bool | None = None,
    max_steps: int = 0,
    keep_data: bool = True,
    labels: str = "soft",
    messages: str = DEFAULT_MESSAGES,
    data_kind: str = DEFAULT_DATA_KIND,
    data_split: str = "all",
    eval_data: tuple[str | os.PathLike[str], ...] = (),
) -> art.Manifest:
    """Train an EAGLE draft head for ``artifact`` and write artifact ``out``. Returns the new
    manifest; its ``eagle`` entry holds the training report.

    ``out`` must not exist, or be the result of an earlier run on the same ``artifact`` whose
    training folder (``out.training``) is still there: training then continues from its
    checkpoint up to ``minutes`` in all, on the same answers and features. ``keep_data``
    False removes the training folder once ``out`` is written. ``labels``: "soft" (the
    target's top-K distribution) or "greedy" (its choice only), see ``eagle_train``.
    ``messages`` (without ``data``): what the model answers, one of ``MESSAGES``: the real
    requests shipped with specport (``samples.instructions``, read as ``data``), the built-in
    templated collection, requests the model writes itself (``self_messages``), or half of the
    last two.
    ``data_kind`` (with ``data``, see ``train.draft_data``): "answers" (the model answers the
    file's prompts), "text" (the file's written answers or paragraphs, read by prefill alone)
    or "mixed" (both: every written answer, and the model's own answers to the first
    ``MIXED_ANSWERED`` of the prompts); ``sequences`` counts the file's examples used.
    ``data_split`` "tune" or "eval" (with ``data``) takes the seeded half of the file that
    ``bench --prompts-split`` takes (``specport.core.prompt_files``), so a head trained on tune can
    be measured on eval. ``eval_data``: prompt files whose answers are measured at every point
    of the timeline beside the held-apart sets (the bench's chat prompts and
    ``samples.instructions.HELDOUT``)."""
    from specport.core import history

    options = {
        "data": data,
        "minutes": minutes,
        "device": device,
        "sequences": sequences,
        "new_tokens": new_tokens,
        "draft_vocab": draft_vocab,
        "depth": depth,
        "labels": labels,
        "messages": messages,
        "data_kind": data_kind,
        "data_split": data_split,
        "eval_data": [str(e) for e in eval_data],
    }
    with history.operation(
        "train-draft", artifact, history.defaults_of(train_draft), out=out, **options
    ):
        return _train_draft(
            Path(artifact),
            Path(out),
            data,
            minutes,
            device,
            sequences,
            new_tokens,
            draft_vocab,
            depth,
            threads,
            progress,
            max_steps,
            keep_data,
            labels,
            messages,
            data_kind,
            data_split=data_split,
            eval_data=tuple(eval_data),
        )


def training_dir(out: str | os.PathLike[str]) -> Path:
    """Where ``train_draft`` keeps the answers, the feature cache and the checkpoint of
    ``out``: beside it, so a longer run resumes (remove it to free the disk)."""
    return Path(f"{out}.training")


def _train_draft(
    src: Path,
    dst: Path,
    data: str | os.PathLike[str] | None,
    minutes: float,
    device: str,
    sequences: int,
    new_tokens: int,
    draft_vocab: int | None,
    depth: int,
    threads: int,
    progress: bool | None,
    max_steps: int,
    keep_data: bool,
    labels: str,
    messages: str,
    data_kind: str,
    data_split: str = "all",
    eval_data: tuple[str | os.PathLike[str], ...] = (),
) -> art.Manifest:
    from specport.loading import load

    work = training_dir(dst)
    resuming = dst.exists()
    given = data
    data = _data_file(data, messages)
    manifest = _check(src, dst, work, data, minutes, device, sequences, depth, messages, eval_data)
    _check_kind(data, data_kind)
    room = _prompt_room(manifest, new_tokens)
    if room < MIN_PROMPT:
        raise UsageError(
            f"--new-tokens {new_tokens} leaves {max(room, 0)} of {src}'s context for a prompt; "
            f"ask for at most {new_tokens + room - MIN_PROMPT} new tokens."
        )
    stages = Stages(total=5, show=progress)
    t0 = time.perf_counter()

    stages.start("adding the feature output to the target graph")
    staged = dst if resuming else work / "artifact"
    if not (staged / art.MANIFEST_NAME).is_file():
        _stage(src, staged, manifest)
    _claim(work, src, manifest)
    target = load(staged, threads=threads)
    if resuming:  # checked when it was written
        recorded = target.manifest.extra.get("eagle", {}).get("training", {})
        logits_diff = float(recorded.get("logits_max_abs_diff", 0.0))
    else:
        logits_diff = _logits_unchanged(load(src, threads=threads), target)

    stages.start("answering the prompt collection")
    seqs, starts, answer_seconds = _sequences(
        src, target, data, data_kind, sequences, messages, work, new_tokens, data_split
    )

    stages.start("computing the target's features")
    from specport.train.eagle_cache import build_cache, build_seconds

    dim = _feature_dim(target)
    cache = build_cache(work / "features", seqs, starts, dim, _runner(target), progress)
    feature_seconds = time.perf_counter() - t0
    chat = _eval_caches(src, target, work, new_tokens, dim, progress, eval_data)

    stages.start(f"training the draft head ({minutes:g} minutes)")
    head, report = _train(
        staged,
        target.manifest,
        cache,
        work,
        minutes,
        device,
        draft_vocab,
        depth,
        threads,
        progress,
        max_steps,
        chat,
        labels,
    )

    stages.start("writing the draft graph")
    from specport.artifact.files import write_artifact_manifest
    from specport.exporter.eagle_artifact import (
        DRAFT_FILE,
        INT8_DRAFT_FILE,
        MANIFEST_KEY,
        eagle_record,
        export_draft,
        write_cpu_draft,
    )
    from specport.self_messages import sampling_seconds

    del target  # its session holds the graph files open
    tmp = staged / f"{DRAFT_FILE}.tmp"
    export_draft(head, tmp)
    os.replace(tmp, staged / DRAFT_FILE)
    final = art.read_manifest(staged, check_hashes=False)
    tmp = staged / f"{INT8_DRAFT_FILE}.tmp"
    int8_attention = write_cpu_draft(head, staged / DRAFT_FILE, tmp, final.context_length)
    os.replace(tmp, staged / INT8_DRAFT_FILE)
    feature_pass: dict[str, Any] = next(
        (p for p in final.passes if p.get("output") == EAGLE_FEATURES), {}
    )
    report.update(
        {
            "source": _source_description(data, data_kind),
            "data": _data_description(given, messages),
            "data_kind": data_kind if data else "answers",
            "sequences": len(seqs),
            "positions": int(cache.offsets[-1]),
            "new_tokens": new_tokens,
            "data_and_features_seconds": round(feature_seconds, 1),
            # as measured when computed (a resumed run reuses them): the data's real cost
            "answers_seconds": answer_seconds,
            "features_seconds": build_seconds(work / "features"),
            "messages_seconds": None if data or messages == "builtin" else sampling_seconds(work),
            "logits_max_abs_diff": logits_diff,
        }
    )
    final.extra[MANIFEST_KEY] = eagle_record(head, feature_pass, report, int8_attention)
    write_artifact_manifest(staged, final)
    if not resuming:
        if dst.exists():
            raise OutputError(f"{dst} appeared while training; the result is left in {staged}.")
        os.replace(staged, dst)
    if not keep_data:
        shutil.rmtree(work, ignore_errors=True)
    stages.done()
    return final


def _data_file(data: Any, messages: str) -> Any:
    """The prompt file the model answers: ``data``, or without it the real requests shipped
    with specport (``messages`` "instructions"); None for the other ``messages``."""
    if data is None and messages == "instructions":
        from specport.samples.instructions import TRAIN

        return TRAIN
    return data


def _source_description(data: Any, data_kind: str) -> str:
    return {
        "answers": "self-distillation (the model's own greedy answers)",
        "text": "the target over the data's written text (prefill, its own next-token labels)",
        "mixed": "the model's own greedy answers and the data's written text (prefill)",
    }[data_kind if data else "answers"]


def _check_kind(data: Any, data_kind: str) -> None:
    if data_kind not in DATA_KINDS:
        raise UsageError(f"--data-kind must be one of {', '.join(DATA_KINDS)}, got {data_kind!r}.")
    if data is None and data_kind == "text":
        raise UsageError(
            "--data-kind text reads written answers: give --data FILE (instruction + output "
            "records, conversations, or plain paragraphs)."
        )
    if data is not None and data_kind == "text":  # read now: a bad file fails before the work
        from specport.train.draft_data import read_examples

        written = sum(1 for e in read_examples(data) if e.answer or not e.chat)
        if written < 16:
            raise InputError(
                f"--data {data} has {written} examples with written text; at least 16 are "
                "needed (for a file of prompts alone use --data-kind answers)."
            )


def _sequences(
    src: Path,
    model: Any,
    data: Any,
    data_kind: str,
    limit: int,
    messages: str,
    work: Path,
    new_tokens: int,
    split: str = "all",
) -> tuple[list[list[int]], list[int], float | None]:
    """The training sequences, where each one's answer starts, and the seconds the answers
    took: the model's answers first (the held-out split, the first sequences, stays answers
    as at runtime), then the written text (``train.draft_data``). Without ``data`` the model
    answers (the built-in collection has no written answers)."""
    from specport.train.draft_data import end_of_turn, read_examples, text_sequences

    kind = data_kind if data is not None else "answers"
    seqs: list[list[int]] = []
    starts: list[int] = []
    seconds = None
    n_answers = {"answers": limit, "text": 0, "mixed": int(limit * MIXED_ANSWERED)}[kind]
    if n_answers:
        prompts = _prompts(src, model, data, n_answers, messages, work, split)
        prompts = [p[-_prompt_room(model.manifest, new_tokens) :] for p in prompts]
        answers, seconds = _answers(work, model, prompts, new_tokens)
        seqs += [p + a for p, a in zip(prompts, answers)]
        starts += [len(p) for p in prompts]
    if kind != "answers":
        template = _template(src, model)
        render = None if template is None else _render(template)
        end = [] if template is None else end_of_turn(template, model.encode)
        examples = read_examples(data, split)[:limit]
        text, text_starts = text_sequences(examples, render, model.encode, new_tokens, end)
        seqs += text
        starts += text_starts
    return seqs, starts, seconds


def _prompt_room(manifest: art.Manifest, new_tokens: int) -> int:
    """Tokens of a prompt that fit before its answer's ``new_tokens``: a longer prompt keeps
    its end (the request's last words and the assistant's header), as the evaluation sets do."""
    from specport.runtime.kv.seq_cache import context_limit

    return context_limit(manifest) - new_tokens


def _template(src: Path, model: Any) -> Any:
    from specport.core.chat_template import load_chat_template

    return load_chat_template(SimpleNamespace(tokenizer=model.tokenizer, path=src))


def _render(template: Any) -> Any:
    return lambda text: template.render_ids([{"role": "user", "content": text}])


def _data_description(data: Any, messages: str) -> str:
    if data:
        return str(data)
    from specport.samples.instructions import SOURCE

    return {
        "instructions": f"120 real requests shipped with specport: {SOURCE}",
        "builtin": "built-in prompt collection (samples.chat_distill)",
        "self": "requests the model wrote itself (self_messages)",
        "mixed": "built-in prompt collection and requests the model wrote itself, alternating",
    }[messages]


def data_size(out: str | os.PathLike[str]) -> int:
    """Bytes the training folder of ``out`` holds (0 when there is none)."""
    work = training_dir(out)
    return sum(p.stat().st_size for p in work.rglob("*") if p.is_file()) if work.is_dir() else 0


def _check(
    src: Path,
    dst: Path,
    work: Path,
    data: Any,
    minutes: float,
    device: str,
    sequences: int,
    depth: int,
    messages: str,
    eval_data: tuple[Any, ...] = (),
) -> art.Manifest:
    manifest = art.read_manifest(src)  # a clear error for a folder that is not an artifact
    art.refuse_hard_linked_weights(art.weight_files(src, manifest))
    if dst.resolve() == src.resolve():
        raise UsageError("--out must differ from the input artifact.")
    if dst.exists():
        _check_resume(src, dst, work, manifest, minutes)
    if data is not None:  # the whole file is read before any work: a bad record stops here
        from specport.core.prompt_files import read_prompt_file

        read_prompt_file(data, "--data")
    for path in eval_data:
        from specport.core.prompt_files import read_prompt_file

        read_prompt_file(path, "--eval-data")
    if messages not in MESSAGES:
        raise UsageError(f"--messages must be one of {', '.join(MESSAGES)}, got {messages!r}.")
    if not minutes > 0:
        raise UsageError(f"--minutes must be positive, got {minutes}.")
    if sequences < 16:
        raise UsageError(f"--sequences must be at least 16, got {sequences}.")
    if not 1 <= depth <= 8:
        raise UsageError(f"--depth must be in 1..8, got {depth}.")
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda, got {device!r}.")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InputError("--device cuda: torch sees no CUDA GPU here; use --device cpu.")
    if manifest.tokenizer.get("kind") in (None, "none"):
        raise InputError(f"{src} has no tokenizer; train-draft reads prompts with it.")
    if data is None and messages in ("self", "mixed"):  # it writes requests after its template
        from specport.core.chat_template import load_chat_template
        from specport.core.tokenizer import load_tokenizer
        from specport.self_messages import user_prefix

        tokenizer = load_tokenizer(src, manifest.tokenizer)
        user_prefix(load_chat_template(SimpleNamespace(tokenizer=tokenizer, path=src)))
    if manifest.quant:
        logger.warning(
            "%s is quantized: the head learns this artifact's own choices (train on the fp32 "
            "artifact and quantize after to share one head)",
            src,
        )
    return manifest


def _check_resume(src: Path, dst: Path, work: Path, manifest: art.Manifest, minutes: float) -> None:
    """An existing ``dst`` may only be trained further: it must be this input's train-draft
    result with its training folder, trained for less than ``minutes``."""
    from specport.train.eagle_train import CHECKPOINT, trained_minutes

    if not (work / CHECKPOINT).is_file() or not (dst / art.MANIFEST_NAME).is_file():
        raise OutputError(
            f"--out {dst} exists and has no training folder ({work}) to continue; train-draft "
            "writes a new artifact and never replaces one. Choose a new directory."
        )
    if _source_key(src, manifest) != _read_run(work).get("source_key"):
        raise OutputError(
            f"--out {dst} was trained from another artifact than {src}; choose a new directory."
        )
    done = trained_minutes(work / CHECKPOINT)
    if minutes <= done + 0.01:
        raise UsageError(
            f"{dst}'s head has trained {done:.1f} minutes already; pass --minutes larger than "
            "that to train it longer."
        )


def _source_key(src: Path, manifest: art.Manifest) -> str:
    """What identifies the input: its graph's and weights' hashes (a moved copy still matches)."""
    return json.dumps(sorted(manifest.files.items()))


def _read_run(work: Path) -> dict[str, Any]:
    path = work / RUN_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def _claim(work: Path, src: Path, manifest: art.Manifest) -> None:
    """Record which input the training folder's data belongs to (checked on resume)."""
    record = {"source": str(src.resolve()), "source_key": _source_key(src, manifest)}
    saved = _read_run(work)
    if saved.get("source_key") not in (None, record["source_key"]):
        raise OutputError(
            f"{work} holds the training data of another artifact ({saved.get('source')}); "
            "remove it or choose another --out."
        )
    if saved != record:
        work.mkdir(parents=True, exist_ok=True)
        (work / RUN_FILE).write_text(json.dumps(record))


def _stage(src: Path, staged: Path, manifest: art.Manifest) -> None:
    """The artifact copied into ``staged`` with the features output (atomically)."""
    from specport.artifact.files import write_artifact_manifest
    from specport.exporter.eagle_artifact import copy_with_features

    tmp = staged.with_name(staged.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    new, _ = copy_with_features(src, tmp, manifest)
    write_artifact_manifest(tmp, new)
    shutil.rmtree(staged, ignore_errors=True)
    os.replace(tmp, staged)


def _logits_unchanged(plain: Any, featured: Any) -> float:
    """Max |logits difference| of the two graphs on one probe sequence (0.0 expected: the
    feature output only reads values the graph computes anyway)."""
    from specport.runtime.kv.seq_cache import open_cache

    probe = [int(t) % plain.manifest.vocab_size for t in range(1, 33)]
    a = np.array(open_cache(plain.session, plain.manifest, 64).step(probe).logits, copy=True)
    b = np.array(open_cache(featured.session, featured.manifest, 64).step(probe).logits)
    diff = float(np.abs(a - b).max())
    if diff > 1e-5:
        raise OutputError(
            f"adding the feature output changed the logits (max |diff| {diff:.2e}); please "
            "report this with the artifact's manifest."
        )
    return diff


def _prompts(
    src: Path, model: Any, data: Any, limit: int, messages: str, work: Path, split: str = "all"
) -> list[list[int]]:
    """Token ids of each message: under the chat template when the model has one, else the
    message's own tokens (a base model continues the text). ``messages`` "mixed" alternates
    the built-in collection's and the model's own (so the held-out split, the first
    sequences, holds both)."""
    from specport.core.chat_template import load_chat_template
    from specport.samples.chat_distill import prompts as builtin
    from specport.self_messages import self_messages

    template = load_chat_template(SimpleNamespace(tokenizer=model.tokenizer, path=src))
    if data is not None:
        return _file_prompts(model, template, data, limit, split)
    if messages == "builtin":
        texts = builtin()
    elif messages == "self":
        texts = self_messages(model, template, limit, work)
    else:
        own = self_messages(model, template, (limit + 1) // 2, work)
        texts = [t for pair in zip(builtin(), own) for t in pair]
    texts = [t for t in texts if t][:limit]
    if len(texts) < 16:
        raise InputError(f"--data {data} has {len(texts)} messages; at least 16 are needed.")
    if template is None:
        return [model.encode(t)[:64] for t in texts]
    return [template.render_ids([{"role": "user", "content": t}]) for t in texts]


def _file_prompts(model: Any, template: Any, data: Any, limit: int, split: str) -> list[list[int]]:
    """A prompt file's records (their first turn, after any context they give), rendered as
    ``_prompts`` renders messages."""
    from specport.core.prompt_files import read_prompt_file, select

    records = select(read_prompt_file(data, "--data").records, split=split)[:limit]
    if len(records) < 16:
        raise InputError(
            f"--data {data} has {len(records)} prompts (split {split}); at least 16 are needed."
        )
    return _render_records(model, template, records)


def _render_records(model: Any, template: Any, records: Any) -> list[list[int]]:
    """Token ids of each prompt record: its messages under the chat template, or without one
    its text's first 64 tokens (a base model continues the text)."""
    if template is None:
        return [model.encode(r.text())[:64] for r in records]
    return [template.render_ids(r.messages()) for r in records]


def _answers(
    work: Path, model: Any, prompts: list[list[int]], new_tokens: int, name: str = "answers.json"
) -> tuple[list[list[int]], float | None]:
    """The model's greedy answers and the seconds they took, kept in the training folder: a
    rerun decodes only the prompts it has no answer for (a larger ``--sequences`` or another
    ``--data`` adds to what is there), and reports the seconds the answers it uses cost when
    they were decoded (pro rata to their tokens when it uses part of a batch's)."""
    from specport.train.mtp_data import greedy_answers

    path = work / name
    known: dict[tuple[int, ...], list[int]] = {}
    spent = 0.0  # seconds the answers in `known` took
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("new_tokens") == new_tokens:
            known = {tuple(p): list(a) for p, a in zip(saved["prompts"], saved["answers"])}
            spent = float(saved.get("seconds") or 0.0)
    todo = list({tuple(p): None for p in prompts if tuple(p) not in known})
    if todo:
        logger.info(
            "answering %d prompts (%d answered before)", len(todo), len(prompts) - len(todo)
        )
        t0 = time.perf_counter()
        for chunk, batch in greedy_answers(
            model, [list(p) for p in todo], new_tokens, batch=32, desc="answering"
        ):
            known.update({tuple(p): list(a) for p, a in zip(chunk, batch)})
        spent += time.perf_counter() - t0
        record = {
            "prompts": [list(p) for p in known],
            "new_tokens": new_tokens,
            "answers": list(known.values()),
            "seconds": round(spent, 3),  # ms: a tiny model's answers take < 0.1 s
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    answers = [known[tuple(p)] for p in prompts]
    if not known:
        return answers, None
    held = sum(len(a) for a in known.values()) or 1
    share = sum(len(a) for a in answers) / held
    return answers, round(spent * share, 3)


def _eval_caches(
    src: Path,
    model: Any,
    work: Path,
    new_tokens: int,
    dim: int,
    progress: bool | None,
    eval_data: tuple[Any, ...] = (),
) -> dict[str, Any]:
    """Feature caches of the model's answers to the evaluation sets measured at every point of
    the timeline, each unlike the training data's own held-out split (which shares its
    source): ``chat_prompts``, the 16 ``bench --prompt-set chat`` runs; ``more_chat_prompts``,
    16 others (``--prompt-set chat-more``), which show whether what was tuned on the first set
    holds on requests nobody tuned on; ``self_instruct_heldout``, the 55 real requests
    ``samples.instructions`` holds apart; and each ``eval_data`` file, by its name. The chat
    sets need the model's chat template; the files are rendered as ``--data`` is."""
    from specport.core.chat_template import load_chat_template
    from specport.core.prompt_files import read_prompt_file
    from specport.samples.chat_prompts import chat_prompts
    from specport.samples.instructions import HELDOUT
    from specport.train.eagle_cache import build_cache

    template = load_chat_template(SimpleNamespace(tokenizer=model.tokenizer, path=src))
    limit = _prompt_room(model.manifest, new_tokens)
    sets: list[tuple[str, str, list[list[int]]]] = []  # (name, folder, prompts)
    if template is not None:
        for name, more, folder in (
            ("chat_prompts", False, "chat"),
            ("more_chat_prompts", True, "more_chat"),
        ):
            texts = chat_prompts(more=more)
            sets.append(
                (
                    name,
                    folder,
                    [template.render_ids([{"role": "user", "content": t}]) for t in texts],
                )
            )
    files = [("self_instruct_heldout", "self_instruct_heldout", HELDOUT)]
    files += [(Path(f).stem, f"eval_{Path(f).stem}", f) for f in eval_data]
    for name, folder, path in files:
        while any(name == s[0] for s in sets):  # two files of one name: both measured
            name, folder = f"{name}_", f"{folder}_"
        records = read_prompt_file(path, "--eval-data").records
        sets.append((name, folder, _render_records(model, template, records)))
    caches = {}
    for name, folder, prompts in sets:
        prompts = [p[-limit:] for p in prompts]  # a short context keeps the end of the template
        answers, _ = _answers(work, model, prompts, new_tokens, f"{folder}_answers.json")
        seqs = [p + a for p, a in zip(prompts, answers)]
        caches[name] = build_cache(
            work / f"{folder}_features",
            seqs,
            [len(p) for p in prompts],
            dim,
            _runner(model),
            progress,
        )
    return caches


def _feature_dim(model: Any) -> int:
    out = next(o for o in model.session.get_outputs() if o.name == EAGLE_FEATURES)
    dim = out.shape[-1]
    return int(dim) if isinstance(dim, int) else 3 * int(model.manifest.config["hidden_size"])


def _runner(model: Any) -> Any:
    """ids -> (features [S, 3H], the target's top ids [S, K] (argmax first), their
    probabilities [S, K]) in one run of the target."""
    from specport.runtime.kv.seq_cache import open_cache
    from specport.train.eagle_cache import top_k

    def run(ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        step = open_cache(model.session, model.manifest, len(ids) + 1).step(ids)
        top_ids, top_probs = top_k(np.asarray(step.logits[: len(ids)]))
        return np.array(step.outputs[EAGLE_FEATURES][0, : len(ids)], copy=True), top_ids, top_probs

    return run


def _train(
    staged: Path,
    manifest: art.Manifest,
    cache: Any,
    work: Path,
    minutes: float,
    device: str,
    draft_vocab: int | None,
    depth: int,
    threads: int,
    progress: bool | None,
    max_steps: int,
    also: dict[str, Any],
    labels: str,
) -> tuple[Any, dict[str, Any]]:
    import torch

    from specport.train.eagle_cache import frequent_choices
    from specport.train.eagle_train import train_head

    cfg_in = manifest.config
    vocab = int(cfg_in["vocab_size"])
    n = cache.num_sequences
    n_eval = max(2, n // 20)
    eval_rows, train_rows = list(range(n_eval)), list(range(n_eval, n))
    size = (
        draft_vocab
        if draft_vocab
        else (AUTO_DRAFT_VOCAB if vocab > 2 * AUTO_DRAFT_VOCAB else vocab)
    )
    ids = frequent_choices(cache, train_rows, min(size, vocab), vocab)
    cfg = head_config(manifest, len(ids))
    embed = torch.from_numpy(_embedding(staged, manifest))
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        return train_head(
            cache,
            cfg,
            embed,
            ids,
            train_rows,
            eval_rows,
            work,
            minutes,
            depth=depth,
            device=device,
            progress=progress,
            max_steps=max_steps,
            threads=max(1, threads),
            also=also,
            labels=labels,
        )
    finally:
        torch.set_num_threads(saved_threads)


def head_config(manifest: art.Manifest, draft_vocab: int) -> Any:
    """The head's shape for the target of ``manifest`` (an ``EagleConfig``)."""
    from specport.exporter.eagle_head import EagleConfig

    c = manifest.config
    hidden = int(c["hidden_size"])
    return EagleConfig(
        hidden=hidden,
        heads=int(c["num_heads"]),
        kv_heads=int(c["num_kv_heads"]),
        head_dim=int(c["head_dim"]),
        intermediate=int(c.get("intermediate_size") or 64 * round(hidden * 8 / 3 / 64)),
        rope_theta=float(c.get("rope_theta") or 10000.0),
        eps=1e-5,
        vocab=int(c["vocab_size"]),
        draft_vocab=draft_vocab,
    )


def _embedding(staged: Path, manifest: art.Manifest) -> np.ndarray:
    """The target's token embedding [V, H] (float32), read from the graph's Gather on input_ids."""
    import onnx_ir as ir

    model = ir.load(str(staged / manifest.model_file))
    for node in model.graph:
        if (
            node.op_type == "Gather"
            and node.inputs[1] is not None
            and node.inputs[1].name == "input_ids"
        ):
            table = node.inputs[0]
            if table is not None and table.const_value is not None:
                arr = table.const_value.numpy()
                if arr.dtype.kind == "f" and arr.ndim == 2:
                    return np.array(arr, dtype=np.float32)  # a writable copy for torch
    raise InputError(
        "cannot read the token embedding from the graph (no float Gather on input_ids); "
        "train the draft head on the unquantized artifact."
    )
