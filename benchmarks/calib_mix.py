"""A mixed calibration text: stories, written requests with their answers, technical prose.

GPTQ and importance weights fit the text they are calibrated on: a SmolLM2 file calibrated on
TinyStories alone scored below fp32 on TinyStories and 22% above it on technical prose. This
writes one text of three kinds, interleaved so that `--calib-docs N` takes about N/3 of each:
the first TinyStories documents, the self-instruct seed tasks (instruction, input and the
written answer as one document) and the prose paragraphs of this repository's docs (no tables,
headings, lists or code). None of it is WikiText: the peer table is scored on WikiText-2, so
calibration and evaluation stay apart. llama.cpp's `llama-imatrix` reads the same file.

    python -m benchmarks.calib_mix --docs docs --out calib_mix.txt   # --shared: SPECPORT_SHARED
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
from pathlib import Path

from specport.core.settings import shared_dir
from specport.runtime.eval import read_documents


def prose_paragraphs(docs_dir: Path) -> list[str]:
    """Paragraphs of running text from the Markdown under `docs_dir` (code fences skipped)."""
    out: list[str] = []
    for md in sorted(docs_dir.rglob("*.md")):
        in_code = False
        para: list[str] = []
        for line in [*md.read_text().splitlines(), ""]:
            if line.startswith("```"):
                in_code = not in_code
                para = []
                continue
            if in_code:
                continue
            if line.strip() and not re.match(r"\s*([|#>*-]|\d+\.|<)", line):
                para.append(line.strip())
            elif para:
                text = " ".join(para)
                if len(text.split()) >= 25:
                    out.append(text)
                para = []
    return out


def self_instruct(path: Path) -> list[str]:
    docs = []
    for line in path.read_text().splitlines():
        task = json.loads(line)
        for inst in task.get("instances", []):
            parts = [task["instruction"], inst.get("input", ""), inst.get("output", "")]
            docs.append("\n".join(p.strip() for p in parts if p.strip()))
    return docs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shared", default=str(shared_dir()), help="the shared data folder")
    p.add_argument("--docs", default="docs", help="Markdown folder for the prose part")
    p.add_argument("--stories", type=int, default=200, help="TinyStories documents (the first)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    shared = Path(args.shared)
    if not (shared / "text").is_dir():
        raise SystemExit(f"no shared data at {shared} (set SPECPORT_SHARED or --shared)")
    kinds = [
        read_documents(shared / "text" / "tinystories_valid_dev.txt", args.stories),
        self_instruct(shared / "text" / "prompts" / "self_instruct_seed_tasks.jsonl"),
        prose_paragraphs(Path(args.docs)),
    ]
    mixed = [d for row in itertools.zip_longest(*kinds) for d in row if d]
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"{out} exists; choose a new --out")
    out.write_text("\n\n".join(d.replace("\n\n", "\n") for d in mixed) + "\n")
    print(f"{out}: {len(mixed)} documents ({', '.join(str(len(k)) for k in kinds)})")


if __name__ == "__main__":
    main()
