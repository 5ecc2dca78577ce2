"""Check that Optimum's ORTModelForCausalLM runs a specport artifact with specport's greedy tokens.

Optimum (optimum-onnx 0.1.0) pins transformers<4.58 and cannot share specport's environment, so
this script keeps it in its own virtual environment (built once, with only torch==2.13.0 and
optimum-onnx[onnxruntime]) and runs it there on the artifact directory, as a user would:

    python scripts/check_optimum.py ARTIFACT [ARTIFACT ...] [--build] [--venv DIR]

The venv defaults to $SPECPORT_OPTIMUM_VENV or ~/.cache/specport/optimum-venv; `--build`
creates it when missing (pip, a few minutes). Prints one JSON object per artifact and exits 0
when every artifact's tokens match, 1 when one does not, 2 when the venv is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

PACKAGES = ["torch==2.13.0", "optimum-onnx[onnxruntime]==0.1.0"]
PROMPTS = [[1, 17, 93, 5], [1, 40, 41, 200, 7, 99, 123, 64, 3, 18]]

# Runs inside the Optimum venv: greedy tokens of each prompt (EOS ignored), and the ids
# Optimum's tokenizer gives TEXT when the artifact carries one, as JSON on stdout.
CHILD = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
from optimum.onnxruntime import ORTModelForCausalLM

artifact, prompts, n, text = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
model = ORTModelForCausalLM.from_pretrained(artifact)
out = []
for prompt in prompts:
    ids = torch.tensor([prompt])
    seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    out.append(seq[0, len(prompt):].tolist())
encoded = None
if text:
    from transformers import AutoTokenizer
    encoded = AutoTokenizer.from_pretrained(artifact)(text)["input_ids"]
print(json.dumps({"tokens": out, "encoded": encoded}))
"""
TEXT = "Once upon a time"


def default_venv() -> Path:
    env = os.environ.get("SPECPORT_OPTIMUM_VENV")
    return Path(env) if env else Path.home() / ".cache" / "specport" / "optimum-venv"


def venv_python(path: Path) -> Path:
    return path / "bin" / "python"


def build_venv(path: Path) -> None:
    """Create the venv and install Optimum into it (torch pinned, CPU wheels where pip has them)."""
    print(f"building the Optimum venv at {path} (once)", file=sys.stderr)
    venv.EnvBuilder(with_pip=True, clear=False).create(path)
    py = str(venv_python(path))
    subprocess.run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run([py, "-m", "pip", "install", "-q", *PACKAGES], check=True)


def run_optimum(
    python: Path, artifact: Path, prompts: list[list[int]], n: int, text: str
) -> dict[str, Any]:
    proc = subprocess.run(
        [str(python), "-c", CHILD, str(artifact), json.dumps(prompts), str(n), text],
        capture_output=True,
        text=True,
        cwd=str(Path.home()),  # keep the checkout's packages off the child's import path
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"Optimum failed on {artifact}: {tail[0]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def run_specport(artifact: Path, prompts: list[list[int]], n: int) -> dict[str, Any]:
    import specport

    model = specport.load(artifact, provider="cpu", threads=1)
    tokens = [
        model.generate(prompt_ids=p, max_new_tokens=n, ignore_eos=True).tokens for p in prompts
    ]
    encoded = model.encode(TEXT) if model.tokenizer is not None else None
    return {"tokens": tokens, "encoded": encoded}


def check(python: Path, artifact: Path, prompts: list[list[int]], n: int) -> dict[str, Any]:
    """Greedy tokens (and the prompt's ids, with a tokenizer) from specport and from Optimum."""
    from specport.artifact.files import runtimes_of
    from specport.artifact.manifest import read_manifest

    support = runtimes_of(read_manifest(artifact))["optimum"]
    if support["status"] != "yes":  # the manifest says why; nothing to compare
        return {"artifact": str(artifact), "ok": True, "skipped": support.get("reason")}
    ours = run_specport(artifact, prompts, n)
    try:
        theirs = run_optimum(python, artifact, prompts, n, TEXT if ours["encoded"] else "")
    except RuntimeError as e:
        return {"artifact": str(artifact), "ok": False, "error": str(e), "specport": ours}
    return {"artifact": str(artifact), "ok": ours == theirs, "specport": ours, "optimum": theirs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("artifacts", nargs="+", type=Path)
    p.add_argument("--venv", type=Path, default=default_venv())
    p.add_argument("--build", action="store_true", help="create the venv when it is missing")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--prompts", help="JSON list of prompt id lists (default: two short ones)")
    args = p.parse_args(argv)
    python = venv_python(args.venv)
    if not python.exists():
        if not args.build:
            print(
                f"no Optimum venv at {args.venv}; pass --build to create it "
                "(or set SPECPORT_OPTIMUM_VENV)",
                file=sys.stderr,
            )
            return 2
        build_venv(args.venv)
    prompts = json.loads(args.prompts) if args.prompts else PROMPTS
    ok = True
    for artifact in args.artifacts:
        result = check(python, artifact.resolve(), prompts, args.new_tokens)
        print(json.dumps(result))
        ok = ok and bool(result["ok"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
