"""Calibration: text -> token sequences -> statistics of the inputs of every weight MatMul.

The statistics come from the fp32 ONNX model itself (the artifact alone is enough): a copy of
the graph exposes the MatMul inputs as extra outputs and onnxruntime runs each sequence as a
prefill with past length 0. Per activation we keep what the algorithms need and nothing that
grows with the data: the Gram matrix H = sum x^T x [K, K] (GPTQ, clip search), per-channel
min / max / absmax [K] (static activation ranges, SmoothQuant) and a bounded random sample of
rows (SmoothQuant alpha search, sensitivity).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from specport.contract import prefill_feeds
from specport.documents import read_text_documents
from specport.errors import QuantizationError

logger = logging.getLogger(__name__)


def read_documents(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Documents are separated by blank lines; empty ones are dropped."""
    docs: list[str] = []
    for p in paths:
        found = read_text_documents(p)
        if found is None:
            raise QuantizationError(
                f"calibration file not found: {p}; pass an existing text file to --calib"
            )
        docs.extend(found)
    return docs


def files_sha256(paths: Sequence[str | os.PathLike[str]]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(Path(p).read_bytes())
    return h.hexdigest()


def tokenize(
    docs: Sequence[str], tokenizer_file: Path, bos_token_id: int | None, context: int
) -> list[np.ndarray]:
    """Each document -> int64 ids [T] with BOS prepended, truncated to `context`."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    out = []
    for d in docs:
        ids = tok.encode(d, add_special_tokens=False).ids
        if bos_token_id is not None:
            ids = [bos_token_id, *ids]
        out.append(np.asarray(ids[:context], dtype=np.int64))
    return out


@dataclass
class ActStats:
    """Running statistics of one activation tensor x [rows, K]."""

    k: int
    h: np.ndarray  # [K, K] float64, sum of x^T x
    lo: np.ndarray  # [K] per-channel min
    hi: np.ndarray  # [K] per-channel max
    rows: int = 0
    sample: list[np.ndarray] = field(default_factory=list)
    pending: list[np.ndarray] = field(default_factory=list)

    @classmethod
    def empty(cls, k: int) -> ActStats:
        return cls(k, np.zeros((k, k)), np.full(k, np.inf), np.full(k, -np.inf))

    @property
    def absmax(self) -> np.ndarray:
        return np.maximum(np.abs(self.lo), np.abs(self.hi))

    @property
    def hessian(self) -> np.ndarray:
        return self.h / max(self.rows, 1)

    def rows_sample(self) -> np.ndarray:
        return (
            np.concatenate(self.sample, axis=0)
            if self.sample
            else np.zeros((0, self.k), np.float32)
        )

    def flush(self) -> None:
        if self.pending:
            x64 = np.concatenate(self.pending, axis=0).astype(np.float64)
            self.h += x64.T @ x64
            self.pending = []

    def update(self, x: np.ndarray, rng: np.random.Generator, keep: int) -> None:
        x = x.reshape(-1, self.k)
        # Rows are batched before the Gram update: many small BLAS calls interleaved with
        # onnxruntime runs are dominated by thread wake-ups (10x slower on 2 cores).
        self.pending.append(x)
        if sum(p.shape[0] for p in self.pending) >= 8192:
            self.flush()
        self.lo = np.minimum(self.lo, x.min(0))
        self.hi = np.maximum(self.hi, x.max(0))
        self.rows += x.shape[0]
        have = sum(s.shape[0] for s in self.sample)
        if have < keep:
            take = min(keep - have, x.shape[0])
            idx = rng.choice(x.shape[0], size=take, replace=False)
            self.sample.append(x[idx].astype(np.float32))


def capture(
    model_path: Path,
    tensor_names: Sequence[str],
    sequences: Sequence[np.ndarray],
    keep_rows: int = 2048,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    feeds: Callable[[ort.InferenceSession, np.ndarray], dict[str, np.ndarray]] = prefill_feeds,
) -> dict[str, ActStats]:
    """Run the fp32 model on `sequences` and gather ActStats for each tensor in `tensor_names`.

    `feeds(session, ids [S])` builds one prefill's inputs (the concat contract by default)."""
    if not sequences:
        raise QuantizationError(
            "calibration produced no sequences; pass a non-empty text file to --calib"
        )
    proto = onnx.load(str(model_path), load_external_data=True)
    known = {o.name for o in proto.graph.output}
    for name in tensor_names:
        if name not in known:
            proto.graph.output.append(
                onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
            )
    with tempfile.TemporaryDirectory(prefix="specport-calib-") as tmp:
        path = Path(tmp) / "calib.onnx"
        onnx.save(proto, str(path), save_as_external_data=True, location="calib.onnx.data")
        del proto
        so = ort.SessionOptions()
        so.log_severity_level = 3
        # Idle ORT threads spin by default and starve the numpy work done between runs.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        names = list(tensor_names)
        stats: dict[str, ActStats] = {}
        rng = np.random.default_rng(seed)
        per_seq = max(1, keep_rows // len(sequences) + 1)
        for i, ids in enumerate(sequences):
            outs = sess.run(names, feeds(sess, ids))
            for name, x in zip(names, outs):
                x = np.asarray(x, dtype=np.float32)
                st = stats.get(name)
                if st is None:
                    st = stats[name] = ActStats.empty(x.shape[-1])
                st.update(x, rng, min(keep_rows, per_seq * (i + 1)))
            if progress is not None:
                progress(i + 1, len(sequences))
        for st in stats.values():
            st.flush()
    logger.info("calibrated %d tensors on %d sequences", len(stats), len(sequences))
    return stats
