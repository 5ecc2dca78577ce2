"""OpenVINO GenAI worker for `specport bench --peer openvino-genai`: runs in its own virtual
environment (see peer_openvino.py), never inside specport's.

OpenVINO GenAI's installer (optimum-intel) pins packages that clash with specport's own, so
specport starts this script with the venv's Python and talks to it in JSON lines: one request
per line on stdin, one answer per line on stdout. It imports nothing from specport (specport is
not installed in that venv) and only the standard library besides openvino / openvino_genai.

Requests:
- ``{"op": "load", "model": DIR, "properties": {...}, "mode": "plain"|"lookup"|"draft",
  "draft": DIR|null}`` -> ``{"ok": true, "versions": {...}}``
- ``{"op": "run", "ids": [...], "new_tokens": N, "num_draft": K, "ngram": G}`` ->
  ``{"tokens": [...], "t_start": s, "t_first": s, "t_end": s, "c_start": s, "c_first": s,
  "c_end": s, "writes": n}``: greedy, EOS ignored, exactly N tokens; ``t_first`` is when the
  first new token reached the streamer (prefill done), ``c_start`` / ``c_first`` / ``c_end``
  this process's CPU time (all threads: OpenVINO's own) at the start, then and at the end,
  ``writes`` how many times the streamer was called (one per decoding step: a speculative step
  hands over all the tokens it accepted at once). ``ids`` may be a list of equal-length rows
  (a batch, plain mode): OpenVINO GenAI streams one row only, so there is no streamer,
  ``t_first`` / ``c_first`` are the end and ``rows`` holds every row's tokens.
- ``{"op": "quit"}``.
Any failure answers ``{"error": "one line"}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

PIPE: Any = None  # the loaded LLMPipeline


def _load(req: dict[str, Any]) -> dict[str, Any]:
    global PIPE
    import openvino_genai as ov_genai

    props = dict(req.get("properties") or {})
    mode = req.get("mode", "plain")
    if mode == "lookup":
        props["prompt_lookup"] = True
    elif mode == "draft":
        props["draft_model"] = ov_genai.draft_model(
            req["draft"], "CPU", **(req.get("draft_properties") or props)
        )
    PIPE = ov_genai.LLMPipeline(req["model"], "CPU", **props)
    versions = {"openvino_genai": getattr(ov_genai, "__version__", "?")}
    try:
        import openvino

        versions["openvino"] = openvino.get_version()
    except Exception:  # noqa: BLE001 - a version string is informative only
        pass
    return {"ok": True, "versions": versions}


def _run(req: dict[str, Any]) -> dict[str, Any]:
    if PIPE is None:
        return {"error": "no model loaded"}
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    n = int(req["new_tokens"])
    config = PIPE.get_generation_config()
    config.max_new_tokens = n
    # EOS may be picked but does not stop generation (min_new_tokens would mask EOS instead,
    # changing the greedy token where specport's plain greedy ends with EOS)
    config.min_new_tokens = 0
    config.ignore_eos = True
    config.do_sample = False
    config.num_beams = 1
    if req.get("mode") in ("lookup", "draft"):
        config.num_assistant_tokens = int(req.get("num_draft", 4))
    if req.get("mode") == "lookup":
        config.max_ngram_size = int(req.get("ngram", 3))
    stamps: list[float] = []
    cpu_first: list[float] = []

    class Stamp(ov_genai.StreamerBase):  # type: ignore[misc,name-defined]
        """Records when each step's tokens arrive (no detokenization, which would cost time)."""

        def write(self, token: Any) -> Any:
            if not stamps:
                cpu_first.append(time.process_time())
            stamps.append(time.perf_counter())
            return ov_genai.StreamingStatus.RUNNING

        def end(self) -> None:
            pass

    rows = req["ids"] if req["ids"] and isinstance(req["ids"][0], list) else [req["ids"]]
    ids: Any = ov.Tensor(np.asarray(rows, dtype=np.int64))
    streamer = Stamp() if len(rows) == 1 else None  # it streams one row only
    if len(rows) > 1:  # its continuous-batching backend takes a batch with its mask only
        ids = ov_genai.TokenizedInputs(ids, ov.Tensor(np.ones((len(rows), len(rows[0])), np.int64)))
    t_start, c_start = time.perf_counter(), time.process_time()
    out = PIPE.generate(ids, config, streamer)
    t_end, c_end = time.perf_counter(), time.process_time()
    tokens = [int(t) for t in out.tokens[0]]
    return {
        "tokens": tokens,
        "rows": [[int(t) for t in row] for row in out.tokens] if len(rows) > 1 else None,
        "t_start": t_start,
        "c_start": c_start,
        "t_first": stamps[0] if stamps else t_end,
        "t_end": t_end,
        "c_first": cpu_first[0] if cpu_first else c_end,
        "c_end": c_end,
        "writes": len(stamps),
    }


def main() -> int:
    # The protocol owns the real stdout; anything the libraries print goes to stderr.
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if req.get("op") == "quit":
                break
            handler = {"load": _load, "run": _run}.get(req.get("op"))
            answer = handler(req) if handler else {"error": f"unknown op {req.get('op')!r}"}
        except Exception as e:  # noqa: BLE001 - every failure goes back as one line
            answer = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:2000]}"}
        proto.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
