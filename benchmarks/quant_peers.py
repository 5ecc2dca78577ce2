"""Perplexity of quantized SmolLM2-class files from several tools on the same token ids.

Every row is scored with llama.cpp's `llama-perplexity` protocol: the whole text is tokenized
once, cut into chunks of `--ctx` tokens (no BOS: the GGUF says add_bos_token false for
SmolLM2), each chunk runs as one prefill with an empty cache, and the loss is the mean NLL of
the second half of each chunk (positions ctx/2 .. ctx-1). llama.cpp rows are scored by
`llama-perplexity` itself; specport artifacts, onnxruntime-genai graphs and OpenVINO IR folders
(nncf-compressed by optimum-intel; scored in OpenVINO GenAI's own venv) by the same protocol
here, on ids from the reference artifact's tokenizer.json. The fp32 rows of the
tools agreeing to four digits is the check that the ids and the protocol are the same.

Each row prints its bits per weight as stored (every tensor's bytes over the float model's
parameter count: core/weight_size.py for ONNX, the GGUF's tensor bytes for llama.cpp, as
llama-quantize reports it) and its perplexity change against the first row of its own kind
(list each tool's fp32 file first):

    python -m benchmarks.quant_peers --text wiki.test.raw --chunks 40 --ref smollm \\
        --llama-bin llama.cpp/build/bin \\
        specport:smollm specport:Q genai:GENAI_FP32/model.onnx genai:GENAI_INT4/model.onnx \\
        llama:F32.gguf llama:Q4_K_M.gguf ov:OV_INT4_DIR

(`ov:` rows compare against the first `ov` row, or `--base ov=PPL`: give the fp32 export's
figure, `--base ov=27.29948`, when no OpenVINO fp32 IR is scored.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from specport.artifact.manifest import read_manifest
from specport.core.weight_size import artifact_weight_size, model_weight_size
from specport.runtime import eval as E


def _genai_logits(model: Any, ids: np.ndarray, head_dim: int) -> np.ndarray:
    """One prefill with an empty cache through the builder's IO (its head dim is symbolic)."""
    feeds: dict[str, np.ndarray] = {}
    for i in model.sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = ids[None, :]
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((1, len(ids)), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(len(ids), dtype=np.int64)[None, :]
        elif i.name.startswith("past_key_values."):
            feeds[i.name] = np.zeros((1, i.shape[1], 0, head_dim), np.float32)
    (out,) = model.sess.run(["logits"], feeds)
    return np.asarray(out[0])


def chunk_tokens(
    ref: Path, text: str, ctx: int, chunks: int, bos: int | None = None
) -> list[np.ndarray]:
    """The text's ids (reference tokenizer, no BOS) cut into `chunks` chunks of `ctx`; with
    `bos`, each chunk's first id replaced by it, as llama-perplexity does for a model whose
    GGUF adds a BOS (stories260K)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ref / "tokenizer.json"))
    ids = np.asarray(tok.encode(Path(text).read_text(), add_special_tokens=False).ids, np.int64)
    n = min(chunks, len(ids) // ctx)
    out = [ids[i * ctx : (i + 1) * ctx].copy() for i in range(n)]
    if bos is not None:
        for c in out:
            c[0] = bos
    return out


def second_half_nll(logits: np.ndarray, ids: np.ndarray) -> tuple[float, int]:
    """llama-perplexity's count: logits at ctx/2 .. ctx-2 predict ids ctx/2+1 .. ctx-1."""
    first = len(ids) // 2
    lp = E._log_softmax(logits[first:-1])
    return -float(lp[np.arange(len(lp)), ids[first + 1 :]].sum()), len(lp)


def score_onnx(kind: str, path: str, ref: Path, chunks: list[np.ndarray]) -> dict[str, Any]:
    c = read_manifest(ref, check_hashes=False).config
    tied = (int(c["vocab_size"]), int(c["hidden_size"])) if c.get("tie_word_embeddings") else None
    if kind == "specport":
        size = artifact_weight_size(path, read_manifest(path, check_hashes=False))
    else:  # a bare graph (onnxruntime-genai's builder output)
        size = model_weight_size(path, tied)
    model = E._open(path)
    t0, c0 = time.perf_counter(), time.process_time()
    nll, count = 0.0, 0
    for ids in chunks:
        if kind == "specport":
            logits = E._logits(model, ids)
        else:
            logits = _genai_logits(model, ids, int(c["head_dim"]))
        a, b = second_half_nll(logits, ids)
        nll, count = nll + a, count + b
    return {
        "ppl": math.exp(nll / count),
        "tokens": count,
        "bits_per_weight": round(size.bits_per_weight, 3),
        "weight_mb": round(size.weight_bytes / 1e6, 1),
        "seconds": round(time.perf_counter() - t0, 1),
        "cpu_seconds": round(time.process_time() - c0, 1),
    }


# Runs in OpenVINO GenAI's own venv (peer_openvino.py): the IR's full-sequence logits per chunk.
_OV_SCORER = """
import json, sys
import numpy as np, openvino as ov
xml, ids_file, props = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
req = ov.Core().compile_model(xml, "CPU", props).create_infer_request()
nll, count = 0.0, 0
for ids in np.load(ids_file):
    req.reset_state()
    n = len(ids)
    req.infer({"input_ids": ids[None], "attention_mask": np.ones((1, n), np.int64),
               "position_ids": np.arange(n)[None], "beam_idx": np.zeros(1, np.int32)})
    z = req.get_tensor("logits").data[0, n // 2 : -1].astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    nll -= float(lp[np.arange(len(lp)), ids[n // 2 + 1 :]].sum())
    count += len(lp)
print(json.dumps({"nll": nll, "count": count}))
"""


def score_openvino(
    path: str, chunks: list[np.ndarray], threads: int, precision: str, params: int
) -> dict[str, Any]:
    """An OpenVINO IR folder (optimum-intel's export, nncf's weights) on the same ids, in
    OpenVINO's venv; `precision` f32 (exact compute: the weights' loss alone) or default
    (OpenVINO's own, bf16 on AVX512-BF16/AMX CPUs). Size: the IR's .bin over `params`."""
    import tempfile

    from specport.bench.peer_openvino import PRECISIONS, ensure_venv

    python = ensure_venv(progress=True)
    props = {"INFERENCE_NUM_THREADS": threads, **PRECISIONS[precision]}
    t0 = time.perf_counter()
    before = os.times()
    with tempfile.TemporaryDirectory() as tmp:
        ids_file = Path(tmp) / "ids.npy"
        np.save(ids_file, np.stack(chunks))
        xml = str(Path(path) / "openvino_model.xml")
        cmd = [str(python), "-c", _OV_SCORER, xml, str(ids_file), json.dumps(props)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    after = os.times()
    if out.returncode != 0:
        raise SystemExit(f"OpenVINO scoring of {path} failed:\n{out.stderr[-2000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    nbytes = (Path(path) / "openvino_model.bin").stat().st_size
    return {
        "ppl": math.exp(got["nll"] / got["count"]),
        "tokens": got["count"],
        "bits_per_weight": round(8 * nbytes / params, 3),
        "weight_mb": round(nbytes / 1e6, 1),
        "precision": precision,
        "seconds": round(time.perf_counter() - t0, 1),
        "cpu_seconds": round(
            (after.children_user + after.children_system)
            - (before.children_user + before.children_system),
            1,
        ),
    }


def gguf_bits(path: str) -> tuple[float, int]:
    """Tensor bytes x 8 over elements (llama-quantize's BPW), and the tensor bytes."""
    import gguf

    r = gguf.GGUFReader(path)
    nbytes = sum(int(t.n_bytes) for t in r.tensors)
    return 8 * nbytes / sum(int(t.n_elements) for t in r.tensors), nbytes


def score_llama(
    path: str, text: str, ctx: int, chunks: int, bin_dir: Path, threads: int, extra: list[str]
) -> dict[str, Any]:
    cmd = [
        str(bin_dir / "llama-perplexity"),
        *("-m", path, "-f", text, "-c", str(ctx), "--chunks", str(chunks), "-t", str(threads)),
        *("-b", str(ctx)),
        *extra,
    ]
    t0 = time.perf_counter()
    before = os.times()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    after = os.times()
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if m is None:
        raise SystemExit(f"no PPL in llama-perplexity's output for {path}:\n{out.stderr[-2000:]}")
    bits, nbytes = gguf_bits(path)
    return {
        "ppl": float(m.group(1)),
        "tokens": chunks * (ctx - ctx // 2 - 1),
        "bits_per_weight": round(bits, 3),
        "weight_mb": round(nbytes / 1e6, 1),
        "seconds": round(time.perf_counter() - t0, 1),
        "cpu_seconds": round(
            (after.children_user + after.children_system)
            - (before.children_user + before.children_system),
            1,
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "models",
        nargs="+",
        help="specport:ARTIFACT, genai:GRAPH.onnx, llama:F.gguf, or ov:IR_DIR / ov-default:IR_DIR "
        "(OpenVINO in its own venv at exact f32 / at its default precision)",
    )
    p.add_argument("--ref", required=True, help="the float specport artifact (tokenizer)")
    p.add_argument("--text", required=True)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=40)
    p.add_argument("--llama-bin", default="../peers/llama.cpp/build/bin")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--llama-arg",
        action="append",
        default=[],
        help="an extra llama-perplexity argument (repeat; e.g. --llama-arg=--no-repack where "
        "the repacked Q4_0 kernels stop with an illegal instruction)",
    )
    p.add_argument(
        "--base",
        action="append",
        default=[],
        help="KIND=PPL: that kind's fp32 perplexity from an earlier run of the same chunks",
    )
    p.add_argument(
        "--bos-id",
        type=int,
        default=None,
        help="replace each chunk's first id by this BOS id (llama-perplexity does so for a "
        "GGUF with add_bos_token true: stories260K's 1; SmolLM2's GGUF adds none)",
    )
    args = p.parse_args()
    chunks = chunk_tokens(Path(args.ref), args.text, args.ctx, args.chunks, args.bos_id)
    base = {k: float(v) for k, v in (b.split("=", 1) for b in args.base)}
    rows = []
    for spec in args.models:
        kind, path = spec.split(":", 1)
        load = os.getloadavg()[0]
        if kind == "llama":
            row = score_llama(
                path,
                args.text,
                args.ctx,
                len(chunks),
                Path(args.llama_bin),
                args.threads,
                args.llama_arg,
            )
        elif kind in ("ov", "ov-default"):
            ref_size = artifact_weight_size(args.ref, read_manifest(args.ref, check_hashes=False))
            precision = "default" if kind == "ov-default" else "f32"
            row = score_openvino(path, chunks, args.threads, precision, ref_size.params)
        else:
            row = score_onnx(kind, path, Path(args.ref), chunks)
        base.setdefault(kind, row["ppl"])
        row = {"kind": kind, "path": path, **row, "load": round(load, 2)}
        row["delta_pct"] = round(100 * (row["ppl"] / base[kind] - 1), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| file | bits per weight | MB | perplexity | Δ vs own fp32 |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['kind']}: {Path(r['path']).name} | {r['bits_per_weight']:.2f} | "
            f"{r['weight_mb']:.1f} | {r['ppl']:.4f} | {r['delta_pct']:+.2f}% |"
        )


if __name__ == "__main__":
    main()
