#!/usr/bin/env bash
# scripts/gpu_check.sh: prove specport's CUDA path on one NVIDIA GPU, in a few minutes.
#
# STATUS: NOT YET RUN ON A GPU. Written and checked on a CPU-only machine (bash -n, and the
# no-GPU path below, which exits 1 with one line). The first run on a GPU is the real test;
# put its figures in the docs and delete this line.
#
# What it checks, in order, writing every result to $OUT_DIR/gpu_check.json (and a short
# gpu_check_results.md beside it):
#   1. a GPU is there (nvidia-smi); else one line "no NVIDIA GPU found" and exit 1
#   2. onnxruntime-gpu and onnxruntime-genai-cuda import and list CUDAExecutionProvider
#      (installed from $WHEELS if that folder holds wheels, else from the package index)
#   3. export the model (default: the shared SmolLM2-135M GGUF) with --target cuda --dtype
#      fp16, and once more in fp32
#   4. greedy tokens of both artifacts on the CUDA provider against transformers on the GPU
#      (fp32 must be equal; fp16 reports the first position where it departs, if any)
#   5. every speculative method (ngram, suffix, draft; mtp when the artifact has heads) gives
#      the same tokens as plain greedy decoding on the CUDA provider
#   6. plain decoding speed: `specport bench --provider cuda` against onnxruntime-genai's
#      CUDA build of the same checkpoint (fp16, same prompt length and new tokens)
#
# Usage:  bash scripts/gpu_check.sh [MODEL]        (MODEL: GGUF file, HF directory or hub id)
# Env:    OUT_DIR (default $OUT, else ./gpu_check_out), SPECPORT_SHARED (specport's shared data folder setting),
#         WHEELS (default .whl: offline wheels, see --fetch-wheels), PYTHON (default python3),
#         NEW_TOKENS (default 128), PROMPT_LEN (default 32), RUNS (default 3)
# Offline GPU machine: on a machine with pip access run
#         bash scripts/gpu_check.sh --fetch-wheels [PYVER]   (default PYVER 3.12)
# which downloads the manylinux wheels into $WHEELS, then carry that folder along.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-$ROOT/.whl}
NEEDS=(onnxruntime-gpu onnxruntime-genai-cuda gguf onnx-ir)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  pyver=${2:-3.12}
  mkdir -p "$WHEELS"
  for pkg in "${NEEDS[@]}"; do
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "$pyver" \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" "$pkg" \
      || { echo "gpu_check: could not download $pkg for Python $pyver" >&2; exit 1; }
  done
  echo "gpu_check: wheels in $WHEELS"
  exit 0
fi

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "gpu_check: no NVIDIA GPU found (nvidia-smi missing or lists no GPU); nothing was checked." >&2
  exit 1
fi

OUT_DIR=${OUT_DIR:-${OUT:-$PWD/gpu_check_out}}
MODEL=${1:-}  # default: SmolLM2 in the shared data folder, resolved once specport is installed
NEW_TOKENS=${NEW_TOKENS:-128}
PROMPT_LEN=${PROMPT_LEN:-32}
RUNS=${RUNS:-3}
WORK=$(mktemp -d -t gpu_check.XXXXXX)  # under $TMPDIR when set
mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/gpu_check.log
exec > >(tee -a "$LOG") 2>&1
step() { echo "== [$(date +%T)] $*"; }
fail() { echo "gpu_check: $*" >&2; exit 1; }

step "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# A virtual environment on top of the system's packages (torch and transformers come from
# there); onnxruntime-gpu in the venv shadows a CPU onnxruntime outside it.
"$PYTHON" -m venv --system-site-packages "$WORK/venv" || fail "could not create a venv"
PY=$WORK/venv/bin/python
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl || fail "installing $WHEELS failed"
else
  "$PY" -m pip install -q "${NEEDS[@]}" \
    || fail "pip could not install ${NEEDS[*]} (offline? run --fetch-wheels where pip works)"
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" || fail "installing specport failed"
if [[ -z "$MODEL" ]]; then
  SHARED=$("$PY" -c 'from specport.core.settings import shared_dir; print(shared_dir())')
  MODEL=$SHARED/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
  [[ -e "$MODEL" ]] || fail "model not found: $MODEL (set SPECPORT_SHARED or pass a GGUF / HF directory)"
fi
"$PY" - <<'EOF' || fail "onnxruntime-gpu has no CUDA provider here (CUDA/cuDNN libraries missing?)"
import onnxruntime as ort, onnxruntime_genai as og
assert "CUDAExecutionProvider" in ort.get_available_providers(), ort.get_available_providers()
print("onnxruntime", ort.__version__, "genai", og.__version__)
EOF

step "export $MODEL (--target cuda, fp16 and fp32)"
for dt in fp16 fp32; do
  "$PY" -m specport export "$MODEL" --out "$WORK/art_$dt" --target cuda --dtype "$dt" -q \
    || fail "export --target cuda --dtype $dt failed"
done

step "greedy tokens, speculative exactness and speed"
"$PY" - "$WORK" "$MODEL" "$OUT_DIR" "$NEW_TOKENS" "$PROMPT_LEN" "$RUNS" <<'EOF'
"""Steps 4-6; one JSON file of results, then a short markdown summary."""
import json, subprocess, sys, time
from pathlib import Path

import numpy as np

work, model, out_dir = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
new_tokens, prompt_len, runs = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
py = str(work / "venv" / "bin" / "python")
results = {"model": model, "new_tokens": new_tokens, "prompt_len": prompt_len, "ok": True}
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip()
results["gpu"] = gpu
PROMPT = "The capital of France is"
IDS: list[int] = []


def specport(*args: str) -> dict:
    r = subprocess.run([py, "-m", "specport", *args, "--json"], capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(r.stdout)


def tokens(art: Path, *extra: str) -> dict:
    return specport("generate", str(art), "--prompt-ids", ",".join(map(str, IDS)),
                    "--max-new-tokens", "64", "--ignore-eos", "--provider", "cuda", *extra)


# 4. greedy tokens vs transformers on the GPU
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from specport.exporter import source as src_mod

hf_dir = src_mod.resolve(model).path
# The same prompt ids on both sides: the artifact's tokenizer with its own special tokens.
IDS = Tokenizer.from_file(str(work / "art_fp32" / "tokenizer.json")).encode(PROMPT).ids
results["prompt_ids"] = IDS
checks = {}
for dt, torch_dt in (("fp32", torch.float32), ("fp16", torch.float16)):
    art = work / f"art_{dt}"
    ours = tokens(art)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch_dt).cuda().eval()
    hf.generation_config.eos_token_id = None  # like --ignore-eos: EOS is a token like others
    with torch.no_grad():
        gen = hf.generate(torch.tensor([IDS], device="cuda"), max_new_tokens=64, do_sample=False)
    ref = gen[0, len(IDS):].tolist()
    got = ours.get("tokens", [])
    first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    same = first is None and len(ref) == len(got)
    checks[dt] = {"equal": same, "first_difference": first, "ours": got[:16], "transformers": ref[:16],
                  "error": ours.get("error")}
    if dt == "fp32" and not same:
        results["ok"] = False
    del hf
    torch.cuda.empty_cache()
results["greedy_vs_transformers"] = checks

# 5. speculative methods give plain greedy's tokens
art = work / "art_fp16"
plain = tokens(art).get("tokens")
spec = {}
for method, extra in (("ngram", []), ("suffix", []), ("draft", ["--draft", str(art)])):
    got = tokens(art, "--speculative", method, *extra)
    spec[method] = {"equal": got.get("tokens") == plain, "error": got.get("error")}
    results["ok"] &= spec[method]["equal"]
manifest = json.loads((art / "specport.json").read_text())
if manifest.get("mtp"):
    got = tokens(art, "--speculative", "mtp")
    spec["mtp"] = {"equal": got.get("tokens") == plain, "error": got.get("error")}
    results["ok"] &= spec["mtp"]["equal"]
else:
    spec["mtp"] = {"skipped": "the artifact has no MTP heads (specport train-mtp makes them)"}
results["speculative_exact"] = spec

# 6. plain decoding speed: specport vs onnxruntime-genai's CUDA build (fp16)
bench = specport("bench", str(art), "--provider", "cuda", "--prompt-len", str(prompt_len),
                 "--new-tokens", str(new_tokens), "--runs", str(runs))
results["specport_bench"] = bench
try:
    import onnxruntime_genai as og

    gdir = work / "genai_fp16"
    subprocess.run([py, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(gdir),
                    "-p", "fp16", "-e", "cuda"], check=True, capture_output=True)
    gm = og.Model(str(gdir))
    prompt = np.random.default_rng(0).integers(100, 1000, prompt_len).tolist()
    times = []
    for r in range(runs + 1):  # the first run warms up
        params = og.GeneratorParams(gm)
        params.set_search_options(max_length=prompt_len + new_tokens, min_length=prompt_len + new_tokens,
                                  do_sample=False)
        gen = og.Generator(gm, params)
        gen.append_tokens([prompt])
        gen.generate_next_token()  # prefill + first token
        t0 = time.perf_counter()
        n = 0
        while not gen.is_done():
            gen.generate_next_token()
            n += 1
        if r:
            times.append((time.perf_counter() - t0) / max(n, 1))
        del gen
    tpot = float(np.median(times))
    results["genai_cuda"] = {"tpot_ms": round(1000 * tpot, 3), "decode_tok_per_s": round(1 / tpot, 1)}
except Exception as e:  # noqa: BLE001 - the result file says what broke
    results["genai_cuda"] = {"error": str(e).splitlines()[0] if str(e) else type(e).__name__}

(out_dir / "gpu_check.json").write_text(json.dumps(results, indent=1))
lines = [f"# gpu_check results ({time.strftime('%Y-%m-%d %H:%M')}, {gpu})", "",
         f"model: {model}", "",
         "| check | result |", "| --- | --- |"]
for dt, c in checks.items():
    lines.append(f"| greedy {dt} vs transformers (64 tokens) | "
                 f"{'equal' if c['equal'] else 'differs at ' + str(c['first_difference'])} |")
for m, c in spec.items():
    lines.append(f"| speculative {m} == plain greedy | {c.get('skipped') or c['equal']} |")
sb = bench.get("results", bench) if isinstance(bench, dict) else {}
lines.append(f"| specport bench (cuda, fp16) | {json.dumps(sb)[:300]} |")
lines.append(f"| onnxruntime-genai cuda fp16 | {results['genai_cuda']} |")
(out_dir / "gpu_check_results.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
sys.exit(0 if results["ok"] else 1)
EOF
rc=$?
step "results in $OUT_DIR/gpu_check.json and gpu_check_results.md (exit $rc)"
exit $rc
