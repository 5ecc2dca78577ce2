"""Which ops make a verify run compute differently from one-token steps: diff every intermediate.

Greedy speculative decoding gives plain greedy's tokens only if a run over 1 + K tokens
computes every position's numbers exactly as K + 1 one-token steps do (row invariance). This
runs an artifact's graph both ways over the same positions, with every float intermediate
added as a graph output, and names the ops whose output rows differ although their input rows
are equal bit for bit (the ops that break invariance; everything after them differs too):

    python -m benchmarks.row_invariance ARTIFACT [--prompt TEXT] [--tokens 5] [--threads 2]

The prompt is prefilled once (the same run on both sides); then ``--tokens`` tokens (plain
greedy's own continuation) are fed one step at a time, and in one verify run from the same
cache. KV written by the steps is compared position by position with the verify run's.
Batch 1, either KV layout (concat: past in, present out; shared: one buffer per layer).
"""

from __future__ import annotations

import argparse
import collections
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from specport.artifact import manifest as art
from specport.core.tokenizer import encode_prompt, load_tokenizer

# Ops whose first output is float when the graph does not say (contrib ops have no inference);
# SkipSimplifiedLayerNormalization's 4th output is the residual sum the next layer reads.
FLOAT_OUTPUTS = {
    "SkipSimplifiedLayerNormalization": (0, 3),
    "SkipLayerNormalization": (0, 3),
}
FLOAT_OPS = {
    "MatMul", "MatMulNBits", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "Gemm",
    "GroupQueryAttention", "MultiHeadAttention", "Attention", "RotaryEmbedding", "Softmax",
    "RMSNormalization", "SimplifiedLayerNormalization", "LayerNormalization", "Mul", "Div",
    "Sigmoid", "Tanh", "Softcap", "Gelu", "FastGelu", "QuickGelu", "DequantizeLinear",
}  # fmt: skip


@dataclass
class Tap:
    """One intermediate: the node that writes it and the node inputs it depends on."""

    name: str
    node: str
    op: str
    inputs: list[str] = field(default_factory=list)


def instrument(model_path: Path) -> tuple[bytes, list[Tap], list[onnx.NodeProto]]:
    """The graph with its float intermediates as outputs, serialized (weights included)."""
    model = onnx.load(str(model_path))
    graph = model.graph
    declared = {o.name for o in graph.output}
    known = {v.name: v.type.tensor_type.elem_type for v in graph.value_info}
    taps: list[Tap] = []
    for node in graph.node:
        slots = FLOAT_OUTPUTS.get(node.op_type, (0,))
        for i in slots:
            if i >= len(node.output) or not node.output[i]:
                continue
            name = node.output[i]
            elem = known.get(name)
            if elem is None and (node.op_type in FLOAT_OPS or node.op_type in FLOAT_OUTPUTS):
                elem = onnx.TensorProto.FLOAT
            if elem != onnx.TensorProto.FLOAT:
                continue
            taps.append(Tap(name, node.name, node.op_type, [x for x in node.input if x]))
            if name not in declared:
                graph.output.append(onnx.helper.make_tensor_value_info(name, elem, None))
    return model.SerializeToString(), taps, list(graph.node)


class Runner:
    """Runs the graph without IO binding: pasts fed as arrays, presents read back."""

    def __init__(self, model: bytes, manifest: Any, threads: int) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        for key, value in (manifest.quant or {}).get("ort_session_config", {}).items():
            opts.add_session_config_entry(key, value)
        self.session = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
        self.manifest = manifest
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]
        kv = manifest.kv
        self.past = [n for pair in kv.inputs for n in pair]
        self.present = [n for pair in kv.outputs for n in pair]
        self.shared = kv.layout == "shared"
        self.max_length = 256

    def start(self) -> dict[str, np.ndarray]:
        kv, cache = self.manifest.kv, {}
        for (k_in, v_in), heads, kd, vd, dt in zip(
            kv.inputs, kv.num_heads, kv.key_dim, kv.value_dim, kv.dtypes()
        ):
            width = self.max_length if self.shared else 0
            cache[k_in] = np.zeros((1, heads, width, kd), dt)
            cache[v_in] = np.zeros((1, heads, width, vd), dt)
        return cache

    def run(
        self, cache: dict[str, np.ndarray], length: int, ids: list[int]
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Append `ids` after `length` cached positions: (all outputs, the next cache)."""
        s = len(ids)
        feeds: dict[str, Any] = {"input_ids": np.array([ids], dtype=np.int64), **cache}
        total = length + s
        if "attention_mask" in self.inputs:
            feeds["attention_mask"] = np.ones((1, total), dtype=np.int64)
        if "position_ids" in self.inputs:
            feeds["position_ids"] = np.arange(length, total, dtype=np.int64)[None]
        if "seqlens_k" in self.inputs:
            feeds["seqlens_k"] = np.array([total - 1], dtype=np.int32)
        if "total_sequence_length" in self.inputs:
            feeds["total_sequence_length"] = np.array(total, dtype=np.int32)
        if "tree_mask" in self.inputs:  # a chain: each token sees every earlier one
            feeds["tree_mask"] = np.tril(np.ones((s, s), dtype=np.int64))[None]
        if "logits_index" in self.inputs:
            feeds["logits_index"] = np.arange(s, dtype=np.int64)[None]
        missing = set(self.inputs) - set(feeds)
        if missing:
            raise SystemExit(f"this script does not know how to feed {sorted(missing)}")
        values = dict(zip(self.outputs, self.session.run(self.outputs, feeds)))
        return values, {p: values[q] for p, q in zip(self.past, self.present)}


def rows(a: np.ndarray, s: int) -> np.ndarray:
    """The sequence axis of an intermediate of a run over s tokens, moved first ([s, ...])."""
    return np.moveaxis(a, 1, 0) if a.ndim >= 2 and a.shape[1] == s else a[None]


def compare(artifact: Path, prompt: list[int], tokens: int, threads: int) -> dict[str, Any]:
    manifest = art.read_manifest(artifact, check_hashes=False)
    model, taps, nodes = instrument(artifact / manifest.model_file)
    runner = Runner(model, manifest, threads)
    del model
    cache = runner.start()
    pre, cache = runner.run(cache, 0, prompt)
    first = int(np.argmax(pre["logits"][0, -1]))
    # plain: one token a step, each continuing the last (shared buffers are copied: the
    # verify run starts from the cache as the prefill left it)
    steps: list[dict[str, np.ndarray]] = []
    fed, n = [first], len(prompt)
    step_cache = {k: v.copy() for k, v in cache.items()}
    for j in range(tokens):
        out, step_cache = runner.run(step_cache, n + j, [fed[j]])
        steps.append(out)
        fed.append(int(np.argmax(out["logits"][0, -1])))
    fed = fed[:tokens]
    verify, verify_cache = runner.run(dict(cache), n, fed)
    report: dict[str, Any] = {"taps": len(taps), "origins": [], "differs": {}}
    differs: set[str] = set()
    by_output = {t.name: t for t in taps}
    untapped = {o for node in nodes for o in node.output if o and o not in by_output}
    for tap in taps:
        # an untapped input differs when anything upstream of it does (Reshape, Transpose...)
        for node in nodes:
            if any(i in differs for i in node.input):
                differs.update(o for o in node.output if o in untapped)
            if node.name == tap.node:
                break
        if tap.name not in verify:
            continue
        v = rows(verify[tap.name], tokens)
        p = [rows(step[tap.name], 1)[0] for step in steps]
        if v.shape[0] != tokens or v.shape[1:] != p[0].shape:
            continue
        diff = max(float(np.max(np.abs(v[j] - p[j]))) for j in range(tokens))
        first_row = next((j for j in range(tokens) if not np.array_equal(v[j], p[j])), None)
        if first_row is None:
            continue
        differs.add(tap.name)
        report["differs"].setdefault(tap.op, []).append(diff)
        if not any(i in differs for i in tap.inputs):
            report["origins"].append({"op": tap.op, "node": tap.node, "out": tap.name,
                                      "max_abs": diff, "first_row": first_row})  # fmt: skip
    kv_rows = []
    for name in runner.past:
        for j in range(tokens):
            plain_pos = steps[j][runner.present[runner.past.index(name)]][:, :, n + j]
            verify_pos = verify_cache[name][:, :, n + j]
            if not np.array_equal(plain_pos, verify_pos):
                kv_rows.append((name, j, float(np.max(np.abs(plain_pos - verify_pos)))))
    report["kv_differs"] = kv_rows
    vl = rows(verify["logits"], tokens)
    report["logits_max_abs"] = max(
        float(np.max(np.abs(vl[j] - rows(steps[j]["logits"], 1)[0]))) for j in range(tokens)
    )
    report["argmax_equal"] = [
        int(np.argmax(vl[j])) == int(np.argmax(steps[j]["logits"][0, -1])) for j in range(tokens)
    ]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--prompt", default="Once upon a time, there was a little")
    parser.add_argument("--tokens", type=int, default=5, help="verify run width (1 + K)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    manifest = art.read_manifest(args.artifact, check_hashes=False)
    ids = encode_prompt(load_tokenizer(args.artifact, manifest.tokenizer), args.prompt)
    report = compare(args.artifact, ids, args.tokens, args.threads)
    print(f"{args.artifact}: {report['taps']} float intermediates, verify width {args.tokens}")
    counts = collections.Counter(o["op"] for o in report["origins"])
    print("ops whose output rows differ with equal input rows (origins):", dict(counts))
    for o in report["origins"][:12]:
        print(
            f"  {o['op']:<34} {o['node']:<48} max|d| {o['max_abs']:.3g} from row {o['first_row']}"
        )
    print("intermediates that differ, per op:",
          {op: f"{len(d)} (max {max(d):.3g})" for op, d in report["differs"].items()})  # fmt: skip
    print(f"KV positions that differ: {len(report['kv_differs'])}")
    print(f"logits max |d| {report['logits_max_abs']:.3g}; argmax equal {report['argmax_equal']}")


if __name__ == "__main__":
    main()
