"""The `specport` command: parse, call `specport.api`, print. Nothing else lives here.

Exit codes: 0 success, 1 failure with a message (any SpecportError), 2 usage error.
Every command takes --json: one JSON object on stdout, logs on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from specport import __version__
from specport.errors import SpecportError

# Subcommand modules in specport/commands/, in --help order; each has add_parser() and run().
COMMANDS = [
    "demo",
    "export",
    "inspect",
    "generate",
    "serve",
    "optimize",
    "quantize",
    "eval",
    "bench",
    "train_mtp",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specport",
        description="Export decoder-only LLMs to ONNX, optimize the graph, and run it with onnxruntime.",
    )
    parser.add_argument("--version", action="version", version=f"specport {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging on stderr (-vv for debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        if importlib.util.find_spec(f"specport.commands.{name}") is None:
            continue
        module = importlib.import_module(f"specport.commands.{name}")
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(
        level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    _quiet_third_party()
    try:
        return int(args.run(args) or 0)
    except SpecportError as e:
        if getattr(args, "json", False):
            print(json.dumps({"error": str(e), "type": type(e).__name__}))
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _quiet_third_party() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("torch", "torch.onnx", "onnxscript", "transformers", "onnx_ir"):
        logging.getLogger(name).setLevel(logging.ERROR)


def emit_json(obj: Any) -> None:
    print(json.dumps(obj, indent=None, default=_json_default))


def _json_default(o: Any) -> Any:
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)
