"""The `specport` command: parse, call `specport.api`, print. Nothing else lives here.

Exit codes: 0 success, 1 failure with a message (a SpecportError: what went wrong and what to
do), 2 usage error (argparse's, or a UsageError: options that cannot work). Users never see
a traceback: an unexpected error prints one line and asks for a report (`-vv` shows the
traceback). Every command takes --json: one JSON object on stdout, logs on stderr.
`-v`/`-q` work before or after the subcommand. Progress goes to stderr (a bar on a terminal,
lines elsewhere) unless `-q`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from specport import __version__
from specport.core.errors import SpecportError

logger = logging.getLogger(__name__)

# Subcommand modules in specport/commands/, in --help order; each has add_parser() and run().
COMMANDS = [
    "demo",
    "export",
    "inspect",
    "generate",
    "chat",
    "serve",
    "optimize",
    "quantize",
    "eval",
    "bench",
    "loadtest",
    "train_mtp",
    "train_draft",
    "upgrade",
]


def _common_options(defaults: bool) -> argparse.ArgumentParser:
    """-v/-q for the top level (with defaults) and for every subcommand (without, so a value
    given before the subcommand is not reset by the subparser)."""
    common = argparse.ArgumentParser(add_help=False)
    extra: dict[str, Any] = {} if defaults else {"default": argparse.SUPPRESS}
    common.add_argument(
        "-v",
        "--verbose",
        action="count",
        help="more logging on stderr (-vv for debug)",
        **({"default": 0} if defaults else extra),
    )
    common.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress lines or bars on stderr",
        **({"default": False} if defaults else extra),
    )
    return common


class _SubParsers(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Gives every subcommand (and sub-subcommand) the -v/-q options."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        kwargs.setdefault("parents", [])
        kwargs["parents"] = [*kwargs["parents"], _common_options(defaults=False)]
        parser = super().add_parser(name, **kwargs)
        parser.register("action", "parsers", _SubParsers)
        return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specport",
        description="Export decoder-only LLMs to ONNX, optimize the graph, and run it with onnxruntime.",
        parents=[_common_options(defaults=True)],
    )
    parser.register("action", "parsers", _SubParsers)
    parser.add_argument("--version", action="version", version=f"specport {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        if importlib.util.find_spec(f"specport.commands.{name}") is None:
            continue
        module = importlib.import_module(f"specport.commands.{name}")
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from specport.core import progress
    from specport.core.options import cli_names

    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(
        level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    logging.getLogger().setLevel(level)
    _quiet_third_party()
    previous = _unwind_on_sigterm()
    try:
        with progress.shown(not args.quiet), cli_names():
            return int(args.run(args) or 0)
    except Terminated:
        print("terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except Exception:
        if not _TERMINATING:
            return _report_error(args)
        # the handler raised inside a library that turned it into its own error (numpy's
        # shape discovery reports "could not determine the shape ..." in its place): still
        # a termination, and every `finally` above has run on the way out
        print("terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _report_error(args: argparse.Namespace) -> int:
    """One line for the error being handled, and the exit code."""
    try:
        raise
    except SpecportError as e:
        _report(args, str(e), type(e).__name__)
        if e.exit_code == 2:
            print(f"(see: specport {args.command} --help)", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:  # e.g. `specport generate ... | head -1`
        _silence_stdout()
        return 0
    except MemoryError:
        _report(
            args,
            "out of memory; close other programs or use a machine with more RAM.",
            "MemoryError",
        )
        return 1
    except OSError as e:  # disk full, permissions, ...: the system's own words say enough
        _report(args, f"{e.strerror or e}{f': {e.filename}' if e.filename else ''}", "OSError")
        return 1
    except Exception as e:  # noqa: BLE001 - a bug: one line, the traceback only on request
        logger.debug("unexpected error", exc_info=True)
        _report(
            args,
            f"unexpected {type(e).__name__}: {e}. This is a bug in specport; please report it "
            "with the command you ran (add -vv for the traceback).",
            type(e).__name__,
        )
        return 1


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so every `finally` and context manager runs: a killed
    export or quantize removes its half-written temp folder instead of leaving it beside --out.
    A BaseException, like KeyboardInterrupt, so no `except Exception` swallows it."""


_TERMINATING = False  # set by the SIGTERM handler: the process is being stopped


def _raise_terminated(signum: int, frame: Any) -> None:
    global _TERMINATING
    _TERMINATING = True
    raise Terminated


def _unwind_on_sigterm() -> Any:
    """Install the SIGTERM handler (main thread only); the previous handler, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        return None  # whoever started us chose to ignore it
    return signal.signal(signal.SIGTERM, _raise_terminated)


def _report(args: argparse.Namespace, message: str, kind: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps({"error": message, "type": kind}))
    print(f"error: {message}", file=sys.stderr)


def _silence_stdout() -> None:
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except OSError:
        pass


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
