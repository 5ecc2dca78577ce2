"""After int8 KV quantization: does the artifact still answer chat turns like its source?

Perplexity on plain text hides what a chat user sees: on SmolLM2-135M-Instruct an int8 cache
costs −0.3% perplexity on stories yet flips 2.4% of the greedy next tokens of chat answers
(and "What is the capital of France?" gets a French poem instead of "Paris": fp32's first-token
margin there is 0.08 logits). So quantize measures, teacher-forced, how often the quantized
graph's top-1 token equals the source graph's on calibration documents rendered as a chat
exchange (a short user question, the document as the assistant's answer), and warns below a
threshold. Teacher-forced: both graphs read the same tokens, so one early flip does not make
every later position differ.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from specport.core.chat_template import load_chat_template
from specport.passes.quant import calibration as C
from specport.passes.quant.layout import calibration_context, shared_prefill_feeds

logger = logging.getLogger(__name__)

THRESHOLD = 0.99  # top-1 agreement below this warns (SmolLM2-135M all-int8: 0.976)
SEQUENCES = 8
MAX_TOKENS = 160


def chat_exchanges(
    src: Path, docs: Sequence[str], context: int = MAX_TOKENS, count: int = SEQUENCES
) -> list[np.ndarray]:
    """Documents as (user question, assistant answer) chat turns; none without a template."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer

    if not (src / "tokenizer.json").is_file() or not docs:
        return []
    tokenizer = Tokenizer.from_file(str(src / "tokenizer.json"))
    template = load_chat_template(SimpleNamespace(tokenizer=tokenizer, path=src))
    if template is None:
        return []
    out = []
    for i, doc in enumerate(docs[:count]):
        question = docs[(i + 1) % len(docs)].split(".")[0].strip() + "?"
        turns = [{"role": "user", "content": question}, {"role": "assistant", "content": doc}]
        out.append(np.asarray(template.render_ids(turns)[: min(MAX_TOKENS, context)], np.int64))
    return out


def prefill_logits(
    model: Path | Any, sequences: Sequence[np.ndarray], data_folder: str | None = None
) -> list[np.ndarray]:
    """Every position's logits of each sequence, one prefill each; `model` a path or a graph
    proto whose external data lies in `data_folder`."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if data_folder is not None:
        key = "session.model_external_initializers_file_folder_path"
        so.add_session_config_entry(key, data_folder)
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    sess = ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
    return [
        np.asarray(sess.run(["logits"], shared_prefill_feeds(sess, ids))[0][0], np.float32)
        for ids in sequences
    ]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare_logits(reference: Sequence[np.ndarray], other: Sequence[np.ndarray]) -> dict[str, Any]:
    """Top-1 agreement and mean KL(reference || other) over every position but the first."""
    agree = total = 0
    kls = []
    for r, q in zip(reference, other):
        r, q = r[1:], q[1:]
        agree += int((r.argmax(-1) == q.argmax(-1)).sum())
        total += r.shape[0]
        lr, lq = _log_softmax(r), _log_softmax(q)
        kls.append(float((np.exp(lr) * (lr - lq)).sum(-1).mean()))
    return {
        "agreement": round(agree / max(total, 1), 5),
        "kl": round(float(np.mean(kls)) if kls else 0.0, 7),
        "positions": total,
        "sequences": len(reference),
    }


def teacher_forced_agreement(
    reference: Path, quantized: Path, sequences: Sequence[np.ndarray]
) -> dict[str, Any]:
    """compare_logits of two shared-layout graphs, each run as one prefill per sequence."""
    return compare_logits(
        prefill_logits(reference, sequences), prefill_logits(quantized, sequences)
    )


def check_chat_agreement(
    reference: Path,
    quantized: Path,
    src: Path,
    docs: Sequence[str],
    context: int = MAX_TOKENS,
    threshold: float = THRESHOLD,
) -> dict[str, Any] | None:
    """The quantize-time chat check (None when the artifact has no chat template); logs a
    warning when agreement is below `threshold`."""
    sequences = chat_exchanges(src, docs, context)
    if not sequences:
        return None
    result = teacher_forced_agreement(reference, quantized, sequences)
    result["threshold"] = threshold
    result["ok"] = result["agreement"] >= threshold
    if result["ok"]:
        logger.info("int8 KV chat check: top-1 agreement %.2f%%", 100 * result["agreement"])
    else:
        logger.warning(
            "int8 KV chat check: the quantized artifact's greedy next token equals the float "
            "cache's at only %.2f%% of %d chat positions (threshold %.0f%%): chat answers may "
            "change; compare `specport generate --chat` answers, or keep more layers float with "
            "--kv-float-layers",
            100 * result["agreement"],
            result["positions"],
            100 * threshold,
        )
    return result


def check_artifact(
    src: Path, out_dir: Path, manifest: Any, calib_files: Sequence[str | os.PathLike[str]]
) -> dict[str, Any] | None:
    """The chat check of a quantized artifact in `out_dir` against its source `src`."""

    docs = C.read_documents(calib_files)
    file = manifest.model_file
    return check_chat_agreement(
        src / file, out_dir / file, src, docs, calibration_context(manifest)
    )
