"""Peak memory and time of export and quantization at real sizes (random weights, real shapes).

Each step runs as its own process under `/usr/bin/time -v` (peak RSS of the whole process,
wall time) and is compared with the checkpoint's fp32 weight bytes:

    python scripts/bench_scale.py qwen2.5-0.5b --work out/scale             # export only
    python scripts/bench_scale.py qwen2.5-0.5b --work out/scale --quant rtn hqq default \\
        --calib SHARED/text/tinystories_valid_dev.txt --calib-docs 64

(SHARED: the shared data folder, specport's setting SPECPORT_SHARED, by default beside the checkout.)

The checkpoint is written by scripts/random_checkpoint.py (with stories260K's tokenizer copied
in when --tokenizer is given, so calibration text can be tokenized). Report `uptime` with the
figures: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from specport.core.settings import shared_dir

ROOT = Path(__file__).resolve().parent.parent


def timed(cmd: list[str], log: Path) -> dict[str, float]:
    """Run `cmd` under /usr/bin/time -v; returns peak RSS (bytes) and wall seconds."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(["/usr/bin/time", "-v", *cmd], stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    text = log.read_text()
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if rc != 0 or m is None:
        raise SystemExit(f"{' '.join(cmd)} failed (rc {rc}); see {log}")
    return {"peak_rss": int(m.group(1)) * 1024, "wall_s": wall}


def fp32_bytes(model_dir: Path) -> int:
    from specport.exporter.checkpoint import Checkpoint

    ckpt = Checkpoint.open(model_dir)
    assert ckpt is not None
    total = 0
    for info in ckpt.tensors.values():
        n = 4
        for d in info.shape:
            n *= d
        total += n
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("shape")
    ap.add_argument("--work", default="out/specport-scale")  # under the working directory
    ap.add_argument("--kv-layout", default="shared")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokenizer", default=str(shared_dir() / "models" / "stories260K"))
    ap.add_argument("--quant", nargs="*", default=[], help="algorithms to run on the export")
    ap.add_argument("--scheme", default="w4a8")
    ap.add_argument("--calib", default=None)
    ap.add_argument("--calib-docs", type=int, default=64)
    ap.add_argument("--skip-export", action="store_true")
    args = ap.parse_args()
    work = Path(args.work)
    src, art = work / args.shape, work / f"{args.shape}-art"
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    if not (src / "config.json").exists():
        subprocess.check_call(
            [
                py,
                str(ROOT / "scripts/random_checkpoint.py"),
                args.shape,
                str(src),
                "--dtype",
                args.dtype,
            ]
        )
        tok = Path(args.tokenizer)
        for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
            if (tok / name).exists():
                shutil.copy(tok / name, src / name)
    weights = fp32_bytes(src)
    rows = []
    specport = [py, "-m", "specport"]
    if not args.skip_export:
        r = timed(
            [*specport, "export", str(src), "--out", str(art), "--kv-layout", args.kv_layout],
            work / f"{args.shape}-export.log",
        )
        rows.append({"step": f"export --kv-layout {args.kv_layout}", **r})
    for algo in args.quant:
        cmd = [*specport, "quantize", str(art), "--out", str(work / f"{args.shape}-{algo}")]
        cmd += ["--scheme", args.scheme, "--algo", algo]
        if args.calib and algo in ("default", "gptq", "clip"):
            cmd += ["--calib", args.calib, "--calib-docs", str(args.calib_docs)]
        rows.append(
            {
                "step": f"quantize {args.scheme} {algo}",
                **timed(cmd, work / f"{args.shape}-{algo}.log"),
            }
        )
    load = os.getloadavg()
    print(f"{args.shape}: fp32 weights {weights / 1e9:.2f} GB; load average {load[0]:.1f}")
    for r in rows:
        print(
            f"  {r['step']:<32} peak RSS {r['peak_rss'] / 1e9:6.2f} GB "
            f"({r['peak_rss'] / weights:.2f}x)  wall {r['wall_s']:7.1f} s"
        )
    print(json.dumps({"shape": args.shape, "weights": weights, "load": load[0], "rows": rows}))


if __name__ == "__main__":
    main()
