"""Build the attention corpus into a folder (not a test): every graph of
`tests/passes/attention_families.py` (tiny GPT-2 / BERT / DistilBERT / Llama / Megatron graphs
from torch.onnx's TorchScript and dynamo exporters, and blocks written node by node the way
onnxruntime's fusion tests write them), kept between runs.

    .venv/bin/python -m benchmarks.attention_corpus OUT_DIR [--only NAME]
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tests.passes.attention_families import build_corpus


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--only")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name, (_, path) in build_corpus(args.root, args.only).items():
        print(f"{name}\t{path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
