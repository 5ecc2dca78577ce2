"""Two checkouts' decoding, interleaved in one run: each row's speed ratio, new over old.

    python -m benchmarks.engine_ab ART --base OLD_CHECKOUT [--new NEW_CHECKOUT]
        [--eagle EAGLE_ART] [--rounds 5] [--new-tokens 64] [--batches 1 4 16] [--json]

Each checkout runs in a worker process of its own, started with that checkout's virtual
environment (``CHECKOUT/.venv/bin/python -I``, so it imports that checkout's ``specport``; the
worker reports the file it imported, and the run stops if both imported the same one). The
rows: ``generate`` at batch 1, plain and with ``ngram``, ``suffix``, ``auto`` and (with
``--eagle``, an artifact with an EAGLE head) ``eagle`` and ``auto`` (``eagleauto``) drafts; ``generate_batch`` (plain) at each of
``--batches`` requests. Every round runs every row on both checkouts, one after the other,
the order alternating between rounds (old-new, then new-old), so a change in the machine's
load reaches both alike; each worker warms every row up first. Greedy, ``--new-tokens`` tokens
per request with EOS ignored; both checkouts' tokens must be equal (to each other and, for
the speculative rows, to plain decoding's).

Per row and checkout: the median decode speed (new tokens over the call's wall time), the
median CPU speed (new tokens over the generating thread's CPU time, ``time.thread_time``:
with one onnxruntime thread every run computes on that thread, so this does not count the
waits of a loaded machine) and the median host CPU time per decode step outside onnxruntime
(the thread's CPU time minus its time inside the sessions' runs, the target's and the EAGLE
head's, over the call's decode steps: what ``benchmarks.step_overhead`` reports). The ratios
are the medians of each round's new / old. On a shared machine trust the CPU ratios over
the wall ones; print the load average beside any figure (this reports it before and after).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play"
BATCH_PROMPTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play",
    "Write a short poem about the sea.",
    "Explain why the sky is blue in two sentences.",
    "List three uses of a paper clip.",
    "What is the capital of France? Answer and then say one fact about it.",
    "Tom had a red ball. One day",
    "Summarize: the cat sat on the mat and looked at the bird outside the window.",
    "Translate to French: good morning, how are you?",
    "Give me a recipe for pancakes.",
    "The robot walked into the kitchen and",
    "Why do leaves change colour in autumn?",
    "Tell a joke about computers.",
    "Describe a sunset over the mountains.",
    "How many legs does a spider have?",
    "Write the first line of a mystery novel.",
    "A small dog found a bone in the garden. Then",
]


# ---------------------------------------------------------------- the worker (either checkout)


def _count_ort_cpu() -> Any:
    """``benchmarks.step_overhead.count_ort_cpu`` of this file's checkout, loaded by path: the
    worker runs with ``-I`` in the measured checkout's environment, so neither this checkout's
    root nor its ``benchmarks`` package is importable there (and must not be: its
    ``specport`` would shadow the measured one)."""
    path = Path(__file__).with_name("step_overhead.py")
    spec = importlib.util.spec_from_file_location("_step_overhead", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.count_ort_cpu


def worker(artifact: str, eagle: str | None) -> None:
    """Answer one JSON request per stdin line (a row name) with one JSON line of figures."""
    import specport

    count_ort_cpu = _count_ort_cpu()
    spent = [0.0]
    models = {"plain": specport.load(artifact, threads=1)}
    if eagle:
        models["eagle"] = specport.load(eagle, threads=1)
    for model in models.values():
        count_ort_cpu(model.session, spent)
    counted: set[int] = set()

    def count_drafts() -> None:  # the EAGLE head's session opens on its first request
        try:
            from specport.runtime.speculative import eagle as eagle_mod
        except ImportError:
            return
        for opened in list(eagle_mod._SESSIONS.values()):
            session = opened["session"]
            if id(session) not in counted:
                counted.add(id(session))
                count_ort_cpu(session, spent)

    print(json.dumps({"specport": specport.__file__}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        name, new = req["row"], req["new_tokens"]
        spent[0] = 0.0
        c0, w0 = time.thread_time(), time.perf_counter()
        if name.startswith("batch"):
            b = int(name[len("batch") :])
            outs = models["plain"].generate_batch(
                BATCH_PROMPTS[:b], max_new_tokens=new, ignore_eos=True
            )
            tokens = [o.tokens for o in outs]
            steps = max(o.metrics["decode_steps"] for o in outs)
        else:
            model = models["eagle" if name.startswith("eagle") else "plain"]
            method = {"eagleplain": "plain", "eagleauto": "auto"}.get(name, name.split("-")[0])
            kw = {} if method == "plain" else {"speculative": method}
            out = model.generate(PROMPT, max_new_tokens=new, ignore_eos=True, **kw)
            tokens = [out.tokens]
            steps = out.metrics["decode_steps"]
        c1, w1 = time.thread_time(), time.perf_counter()
        count_drafts()
        n = sum(len(t) for t in tokens)
        print(
            json.dumps(
                {
                    "tokens": tokens,
                    "wall_tok_s": n / (w1 - w0),
                    "cpu_tok_s": n / (c1 - c0),
                    "host_ms_per_step": (c1 - c0 - spent[0]) / max(steps, 1) * 1e3,
                    "steps": steps,
                }
            ),
            flush=True,
        )


# ---------------------------------------------------------------- the parent


class Worker:
    """One checkout's worker process."""

    def __init__(self, checkout: Path, artifact: str, eagle: str | None) -> None:
        python = checkout / ".venv" / "bin" / "python"
        if not python.is_file():
            raise SystemExit(f"{checkout}: no .venv/bin/python (make the checkout's venv first)")
        cmd = [str(python), "-I", str(Path(__file__).resolve()), "--worker", artifact]
        if eagle:
            cmd += ["--eagle", eagle]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=checkout
        )
        self.imported = self._read()["specport"]

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise SystemExit(f"a worker ended early (exit {self.proc.wait()})")
        return json.loads(line)  # type: ignore[no-any-return]

    def ask(self, row: str, new_tokens: int) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"row": row, "new_tokens": new_tokens}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--base", help="the checkout measured against (with its own .venv)")
    ap.add_argument("--new", default=".", help="the checkout measured (default: this one)")
    ap.add_argument("--eagle", help="an artifact of the same model with an EAGLE head")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rows", nargs="+", help="only these rows (e.g. ngram batch16)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.artifact, args.eagle)
        return
    if not args.base:
        ap.error("--base is required")
    if any(b > len(BATCH_PROMPTS) for b in args.batches):
        ap.error(f"--batches: at most {len(BATCH_PROMPTS)} requests")
    rows = ["plain", "ngram", "suffix", "auto"]
    rows += ["eagleplain", "eagle", "eagleauto"] if args.eagle else []
    rows += [f"batch{b}" for b in args.batches]
    rows = [r for r in rows if not args.rows or r in args.rows]
    artifact = str(Path(args.artifact).resolve())
    eagle = str(Path(args.eagle).resolve()) if args.eagle else None
    sides = {
        "old": Worker(Path(args.base).resolve(), artifact, eagle),
        "new": Worker(Path(args.new).resolve(), artifact, eagle),
    }
    if sides["old"].imported == sides["new"].imported:
        raise SystemExit(f"both checkouts import {sides['old'].imported}")
    for side in sides.values():  # warm-up, untimed
        for row in rows:
            side.ask(row, 8)
    load = [os.getloadavg()[0]]
    got: dict[str, dict[str, list[dict[str, Any]]]] = {r: {"old": [], "new": []} for r in rows}
    for k in range(args.rounds):
        order = ("old", "new") if k % 2 == 0 else ("new", "old")
        for row in rows:
            for name in order:
                got[row][name].append(sides[name].ask(row, args.new_tokens))
    load.append(os.getloadavg()[0])
    for side in sides.values():
        side.close()
    report: list[dict[str, Any]] = []
    for row in rows:
        old, new = got[row]["old"], got[row]["new"]
        ref = "eagleplain" if row in ("eagle", "eagleauto") else "plain"
        equal = all(r["tokens"] == old[0]["tokens"] for r in old + new)
        if row in ("ngram", "suffix", "auto", "eagle", "eagleauto") and ref in got:
            equal = equal and new[0]["tokens"] == got[ref]["new"][0]["tokens"]

        def ratio(
            key: str, old: list[dict[str, Any]] = old, new: list[dict[str, Any]] = new
        ) -> float:
            return statistics.median(n[key] / o[key] for o, n in zip(old, new))

        def med(runs: list[dict[str, Any]], key: str) -> float:
            return statistics.median(r[key] for r in runs)

        report.append(
            {
                "row": row,
                "wall_ratio": round(ratio("wall_tok_s"), 3),
                "wall_ratio_range": [
                    round(min(n["wall_tok_s"] / o["wall_tok_s"] for o, n in zip(old, new)), 3),
                    round(max(n["wall_tok_s"] / o["wall_tok_s"] for o, n in zip(old, new)), 3),
                ],
                "cpu_ratio": round(ratio("cpu_tok_s"), 3),
                "old_cpu_tok_s": round(med(old, "cpu_tok_s"), 2),
                "new_cpu_tok_s": round(med(new, "cpu_tok_s"), 2),
                "old_host_ms": round(med(old, "host_ms_per_step"), 4),
                "new_host_ms": round(med(new, "host_ms_per_step"), 4),
                "steps": [old[0]["steps"], new[0]["steps"]],
                "equal": equal,
            }
        )
    if args.json:
        print(json.dumps({"load_average": load, "rows": report}))
        return
    print(
        f"{args.rounds} rounds, {args.new_tokens} new tokens, load {load[0]:.1f} -> {load[1]:.1f}"
        f"\nold {sides['old'].imported}\nnew {sides['new'].imported}"
    )
    print(
        "row          wall new/old (range)      cpu new/old  cpu tok/s old   new"
        "   host ms/step old    new  steps  equal"
    )
    for r in report:
        lo, hi = r["wall_ratio_range"]
        print(
            f"{r['row']:11s} {r['wall_ratio']:7.3f} ({lo:.3f}-{hi:.3f}) {r['cpu_ratio']:11.3f}"
            f" {r['old_cpu_tok_s']:13.1f} {r['new_cpu_tok_s']:6.1f}"
            f" {r['old_host_ms']:16.3f} {r['new_host_ms']:6.3f}  {r['steps']}  {r['equal']}"
        )


if __name__ == "__main__":
    main()
