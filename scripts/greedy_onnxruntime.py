"""Greedy-decode a specport concat-layout artifact with nothing but onnxruntime and numpy.

For execution providers that come as a separate onnxruntime build (`onnxruntime-openvino`
replaces the `onnxruntime` package, so it lives in its own virtual environment without
specport): run this file with that environment's Python and compare the printed token ids with
transformers' or specport's. It reads only the artifact's specport.json and model.onnx.

    python scripts/greedy_onnxruntime.py ARTIFACT --provider OpenVINOExecutionProvider \
        --prompt-ids 1,403,407,261,378 --new-tokens 32

Prints one JSON object: {"provider": ..., "tokens": [...], "nodes_on": {...} | null}.
Provider options: `--option key=value` (repeatable), e.g. `--option precision=FP32` for
OpenVINO (its CPU plugin computes in bf16 on CPUs that have it unless told otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort


def greedy(session: ort.InferenceSession, manifest: dict, prompt: list[int], new: int) -> list:
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
    ap.add_argument("--provider", default="CPUExecutionProvider")
    ap.add_argument("--option", action="append", default=[], help="provider option key=value")
    ap.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    manifest = json.loads((args.artifact / "specport.json").read_text())
    if manifest["kv"]["layout"] != "concat":
        print("only concat-layout artifacts (past in, present out) are supported", file=sys.stderr)
        return 1
    options = dict(o.split("=", 1) for o in args.option)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    providers = [(args.provider, options)] if args.provider != "CPUExecutionProvider" else []
    session = ort.InferenceSession(
        str(args.artifact / manifest.get("model_file", "model.onnx")),
        sess_options=so,
        providers=[*providers, "CPUExecutionProvider"],
    )
    nodes_on = None
    if hasattr(session, "get_provider_graph_assignment_info"):
        info = session.get_provider_graph_assignment_info()
        nodes_on = {i.ep_name: len(i.get_nodes()) for i in info} if info else None
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    tokens = greedy(session, manifest, prompt, args.new_tokens)
    used = session.get_providers()
    print(json.dumps({"provider": used[0], "tokens": tokens, "nodes_on": nodes_on}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
