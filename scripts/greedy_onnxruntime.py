"""Greedy-decode a specport concat-layout artifact with onnxruntime (or OpenVINO) and numpy only.

For execution providers that come as a separate onnxruntime build (`onnxruntime-openvino`
replaces the `onnxruntime` package, so it lives in its own virtual environment without
specport): run this file with that environment's Python and compare the printed token ids with
transformers' or specport's. It reads only the artifact's specport.json and model.onnx.

    python scripts/greedy_onnxruntime.py ARTIFACT --provider OpenVINOExecutionProvider \
        --prompt-ids 1,403,407,261,378 --new-tokens 32

`--runtime openvino` runs the graph with OpenVINO's own runtime (`pip install openvino`;
f32 inference and KV precision) instead of onnxruntime.

Prints one JSON object: {"provider": ..., "tokens": [...], "nodes_on": {...} | null}.
Provider options: `--option key=value` (repeatable), e.g. `--option precision=FP32` for
OpenVINO (its CPU plugin computes in bf16 on CPUs that have it unless told otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np


class OpenVINOSession:
    """The two onnxruntime session calls `greedy` makes, answered by OpenVINO's runtime."""

    def __init__(self, path: Path) -> None:
        import openvino as ov

        core = ov.Core()
        hints = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
        self.compiled = core.compile_model(core.read_model(str(path)), "CPU", hints)
        self.version = ov.__version__

    def get_inputs(self) -> list[Any]:
        return [argparse.Namespace(name=i.get_any_name()) for i in self.compiled.inputs]

    def get_outputs(self) -> list[Any]:
        return [argparse.Namespace(name=o.get_any_name()) for o in self.compiled.outputs]

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        result = {k.get_any_name(): v for k, v in self.compiled(feeds).items()}
        return [result[n] for n in names]


def greedy(session: Any, manifest: dict, prompt: list[int], new: int) -> list:
    kv = manifest["kv"]
    dtype = np.dtype(kv.get("dtype") or "float32")
    names = [n for pair in kv["inputs"] for n in pair]
    heads = [h for h in kv["num_heads"] for _ in (0, 1)]
    dims = [d for pair in zip(kv["key_dim"], kv["value_dim"]) for d in pair]
    past = {n: np.zeros((1, h, 0, d), dtype) for n, h, d in zip(names, heads, dims)}
    inputs = {i.name for i in session.get_inputs()}
    outputs = [o.name for o in session.get_outputs()]
    current, done, tokens = list(prompt), 0, []
    for _ in range(new):
        ids = np.array([current], np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, done + len(current)), np.int64)}
        if "position_ids" in inputs:
            feeds["position_ids"] = np.arange(done, done + len(current), dtype=np.int64)[None]
        out = dict(zip(outputs, session.run(outputs, {**feeds, **past})))
        token = int(np.argmax(out["logits"][0, -1]))
        tokens.append(token)
        past = {n: out[p] for n, p in zip(names, [p for pair in kv["outputs"] for p in pair])}
        done += len(current)
        current = [token]
    return tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--runtime", choices=["onnxruntime", "openvino"], default="onnxruntime")
    ap.add_argument("--provider", default="CPUExecutionProvider")
    ap.add_argument("--option", action="append", default=[], help="provider option key=value")
    ap.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    manifest = json.loads((args.artifact / "specport.json").read_text())
    if manifest["kv"]["layout"] != "concat":
        print("only concat-layout artifacts (past in, present out) are supported", file=sys.stderr)
        return 1
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    graph = args.artifact / manifest.get("model_file", "model.onnx")
    if args.runtime == "openvino":
        ov_session = OpenVINOSession(graph)
        tokens = greedy(ov_session, manifest, prompt, args.new_tokens)
        result = {"provider": f"openvino {ov_session.version}", "tokens": tokens, "nodes_on": None}
        print(json.dumps(result))
        return 0
    import onnxruntime as ort

    options = dict(o.split("=", 1) for o in args.option)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    providers = [(args.provider, options)] if args.provider != "CPUExecutionProvider" else []
    session = ort.InferenceSession(
        str(graph),
        sess_options=so,
        providers=[*providers, "CPUExecutionProvider"],
    )
    nodes_on = None
    if hasattr(session, "get_provider_graph_assignment_info"):
        info = session.get_provider_graph_assignment_info()
        nodes_on = {i.ep_name: len(i.get_nodes()) for i in info} if info else None
    tokens = greedy(session, manifest, prompt, args.new_tokens)
    used = session.get_providers()
    print(json.dumps({"provider": used[0], "tokens": tokens, "nodes_on": nodes_on}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
