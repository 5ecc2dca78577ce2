"""Calibration: text -> token sequences -> statistics of the inputs of every weight MatMul.

The statistics come from the fp32 ONNX model itself (the artifact alone is enough): a copy of
the graph exposes the MatMul inputs as extra outputs and onnxruntime runs each sequence as a
prefill with past length 0. Per activation the algorithms need the Gram matrix
H = sum x^T x [K, K] (GPTQ, clip search), per-channel min / max / absmax [K] (static activation
ranges, SmoothQuant) and a bounded random sample of rows (SmoothQuant alpha search,
sensitivity). The rows are spilled to disk during the run and each tensor's statistics are
built when a pass asks for them (`SpilledStats`), so memory holds one layer's statistics, not
the whole model's; onnxruntime maps the artifact's weights rather than loading a copy.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from specport.artifact.manifest import Manifest
from specport.core.contract import prefill_feeds
from specport.core.documents import read_text_documents
from specport.core.errors import QuantizationError
from specport.passes.quant.graph import find_weight_matmuls
from specport.passes.quant.layout import calibration_context, shared_prefill_feeds

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


class SpilledStats(Mapping[str, ActStats]):
    """Activation rows of every calibrated tensor, spilled to disk; `ActStats` on access.

    Keeping a Gram matrix per tensor for the whole model at once costs K^2 float64 per
    tensor (4.5 GB for a 0.5B Qwen2: 24 down projections of K=4864), more than the model. The
    rows are instead appended to one file per tensor as float16 scaled per channel and per row
    (no overflow, ~3 significant digits), and a tensor's statistics are rebuilt when a pass
    asks for them, one at a time: memory holds one layer's working set. `max_rows` caps the
    rows kept per tensor (a uniform random subset of token positions, fixed by `seed`).
    """

    CHUNK = 4096  # rows per Gram update

    def __init__(
        self, directory: Path, keep_rows: int = 2048, seed: int = 0, max_rows: int | None = None
    ) -> None:
        self.directory = Path(directory)
        self.keep_rows, self.seed, self.max_rows = keep_rows, seed, max_rows
        self._files: dict[str, Path] = {}
        self._k: dict[str, int] = {}
        self._rows: dict[str, int] = {}
        self._records: dict[str, list[int]] = {}  # rows per append, in file order
        self._lo: dict[str, np.ndarray] = {}
        self._hi: dict[str, np.ndarray] = {}
        self._cached: tuple[str, ActStats] | None = None
        self.holder: tempfile.TemporaryDirectory[str] | None = None  # owns `directory` if set

    def append(self, name: str, x: np.ndarray) -> None:
        """Record rows x [..., K] of tensor `name` (lo/hi exact, rows as scaled float16)."""
        k = x.shape[-1]
        x = np.asarray(x, dtype=np.float32).reshape(-1, k)
        if name not in self._files:
            self._files[name] = self.directory / f"{len(self._files)}.rows"
            self._k[name], self._rows[name], self._records[name] = k, 0, []
            self._lo[name] = np.full(k, np.inf, np.float32)
            self._hi[name] = np.full(k, -np.inf, np.float32)
        np.minimum(self._lo[name], x.min(0), out=self._lo[name])
        np.maximum(self._hi[name], x.max(0), out=self._hi[name])
        self._rows[name] += x.shape[0]
        self._records[name].append(x.shape[0])
        # Two scales keep every element in float16's normal range: per channel (outlier
        # channels) over this record, then per row (outlier tokens) of what is left.
        col = np.abs(x).max(0)
        col = np.where(col > 0, col, 1.0).astype(np.float32)
        y = x / col
        row = np.abs(y).max(1)
        row = np.where(row > 0, row, 1.0).astype(np.float32)
        with open(self._files[name], "ab") as f:
            f.write(col.tobytes())
            f.write(row.tobytes())
            f.write((y / row[:, None]).astype(np.float16).tobytes())

    def __getitem__(self, name: str) -> ActStats:
        if self._cached is not None and self._cached[0] == name:
            return self._cached[1]
        if name not in self._files:
            raise KeyError(name)
        k = self._k[name]
        scaled, row, col, rec = self._read(name)
        rng = np.random.default_rng(self.seed)
        if self.max_rows is not None and scaled.shape[0] > self.max_rows:
            keep = np.sort(rng.choice(scaled.shape[0], self.max_rows, replace=False))
            scaled, row, rec = scaled[keep], row[keep], rec[keep]

        def rows(idx: Any) -> np.ndarray:
            x = scaled[idx].astype(np.float32)
            x *= row[idx, None]
            x *= col[rec[idx]]
            return x

        # The Gram matrix is the costly part (rows x K^2: 180 GFLOP for one SmolLM2 down
        # projection on 38k rows) and a budget's planner and GPTQ both ask for it: it is
        # built once and kept beside the rows (K^2 float64 on disk, not in memory).
        gram = self._files[name].with_suffix(".gram.npy")
        if gram.is_file():
            h = np.load(gram)
        else:
            h = np.zeros((k, k))
            for start in range(0, scaled.shape[0], self.CHUNK):
                x = rows(slice(start, start + self.CHUNK))
                h += (x.T @ x).astype(np.float64)
            np.save(gram, h)
        take = min(self.keep_rows, scaled.shape[0])
        sample = rows(np.sort(rng.choice(scaled.shape[0], take, replace=False)))
        st = ActStats(k, h, self._lo[name].astype(np.float64), self._hi[name].astype(np.float64))
        st.rows, st.sample = int(scaled.shape[0]), [sample]
        self._cached = (name, st)
        return st

    def _read(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Rows of `name` as written: scaled float16 [R, K], row scales [R], channel scales
        [records, K] and each row's record index [R]."""
        k, total, records = self._k[name], self._rows[name], self._records[name]
        scaled = np.empty((total, k), np.float16)
        row = np.empty(total, np.float32)
        col = np.empty((len(records), k), np.float32)
        rec = np.repeat(np.arange(len(records)), records)
        pos = 0
        with open(self._files[name], "rb") as f:
            for i, n in enumerate(records):
                col[i] = np.frombuffer(f.read(4 * k), np.float32)
                row[pos : pos + n] = np.frombuffer(f.read(4 * n), np.float32)
                scaled[pos : pos + n] = np.frombuffer(f.read(2 * n * k), np.float16).reshape(n, k)
                pos += n
        return scaled, row, col, rec

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def capture(
    model_path: Path,
    tensor_names: Sequence[str],
    sequences: Sequence[np.ndarray],
    keep_rows: int = 2048,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    feeds: Callable[[ort.InferenceSession, np.ndarray], dict[str, np.ndarray]] = prefill_feeds,
    spill_dir: Path | None = None,
    max_rows: int | None = None,
) -> Mapping[str, ActStats]:
    """Run the fp32 model on `sequences` and gather ActStats for each tensor in `tensor_names`.

    `feeds(session, ids [S])` builds one prefill's inputs (the concat contract by default).
    The rows are spilled under `spill_dir` (a temporary directory owned by the result when
    None; see `SpilledStats`). The calibration graph is built in memory and reads the
    artifact's own external data file: no second copy of the weights, on disk or loaded.
    """
    if not sequences:
        raise QuantizationError(
            "calibration produced no sequences; pass a non-empty text file to --calib"
        )
    model_path = Path(model_path)
    proto = onnx.load(str(model_path), load_external_data=False)
    known = {o.name for o in proto.graph.output}
    for name in tensor_names:
        if name not in known:
            proto.graph.output.append(
                onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
            )
    holder = None
    if spill_dir is None:  # removed when the returned statistics are garbage-collected
        holder = tempfile.TemporaryDirectory(prefix="specport-calib-")
        spill_dir = Path(holder.name)
    stats = SpilledStats(Path(spill_dir), keep_rows=keep_rows, seed=seed, max_rows=max_rows)
    stats.holder = holder
    so = ort.SessionOptions()
    so.log_severity_level = 3
    # Idle ORT threads spin by default and starve the numpy work done between runs.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # The graph comes from memory; its external data is read (mapped) from the artifact.
    so.add_session_config_entry(
        "session.model_external_initializers_file_folder_path", str(model_path.parent)
    )
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    del proto
    names = list(tensor_names)
    for i, ids in enumerate(sequences):
        outs = sess.run(names, feeds(sess, ids))
        for name, x in zip(names, outs):
            stats.append(name, x)
        if progress is not None:
            progress(i + 1, len(sequences))
    del sess
    logger.info("calibrated %d tensors on %d sequences", len(stats), len(sequences))
    return stats


def calibration_sequences(
    manifest: Manifest, src: Path, calib_files: Sequence[str | os.PathLike[str]], max_docs: int
) -> tuple[list[np.ndarray], Callable[[ort.InferenceSession, np.ndarray], dict[str, np.ndarray]]]:
    """The first `max_docs` documents of `calib_files` as ids (the artifact's own tokenizer,
    BOS, context) and the prefill feeds of the artifact's KV layout."""
    docs = read_documents(calib_files)[:max_docs]
    tok = src / "tokenizer.json"
    if not tok.is_file():
        raise QuantizationError(
            f"{src} has no tokenizer.json; calibration needs the artifact's tokenizer"
        )
    seqs = tokenize(docs, tok, manifest.config.get("bos_token_id"), calibration_context(manifest))
    return seqs, shared_prefill_feeds if manifest.kv.layout == "shared" else prefill_feeds


def calibrate_artifact(
    model_path: Path,
    manifest: Manifest,
    src: Path,
    calib_files: Sequence[str | os.PathLike[str]],
    max_docs: int,
    progress: Callable[[str, int, int], None] | None,
) -> Mapping[str, ActStats]:
    """Statistics of every weight MatMul's input over the first `max_docs` documents of
    `calib_files`, tokenized with the artifact's own tokenizer (shared layout: run as it runs)."""
    import onnx_ir

    seqs, feeds = calibration_sequences(manifest, src, calib_files, max_docs)
    names = sorted({s.x.name for s in find_weight_matmuls(onnx_ir.load(model_path)) if s.x.name})
    cb = (lambda i, n: progress("calibrate", i, n)) if progress else None
    return capture(model_path, names, seqs, progress=cb, feeds=feeds)
