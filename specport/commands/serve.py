"""`specport serve ARTIFACT --port 8000`: an OpenAI-compatible HTTP server until Ctrl-C / SIGTERM.

One process (FastAPI on uvicorn over one engine), or `--replicas N`: the same app as a Ray Serve
deployment with N replicas, each owning one engine (runtime/serve/ray.py, `specport[ray]`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from specport.cli import emit_json
from specport.commands._args import (
    add_runtime_options,
    add_speculative_options,
    add_suffix_record_option,
    check_speculative,
)
from specport.core.errors import InputError

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve an artifact over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)",
    )
    p.add_argument("artifact")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 = all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0 = any free port)")
    add_runtime_options(p)
    p.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="KV rows, the most requests decoded together (batching engine; default: as many "
        "as fit in half the machine's memory at --max-model-len, at most 64; requests are "
        "admitted by --kv-cache-space)",
    )
    p.add_argument(
        "--kv-cache-space",
        type=float,
        default=None,
        metavar="GIB",
        help="KV memory the running requests may fill, in GiB (batching engine; default: 4, or "
        "a quarter of the available memory if less); a request waits until what it reserves "
        "fits (--preemption-mode)",
    )
    p.add_argument(
        "--preemption-mode",
        choices=["none", "recompute"],
        default="recompute",
        help="batching engine: recompute (default, as vLLM) = a request starts while what the "
        "running ones hold now fits, and when their KV outgrows the space the newest is "
        "preempted and later re-prefills its prompt and tokens so far (same tokens; more "
        "requests run at once when answers stop before max_tokens); none = a request reserves "
        "its prompt plus max_tokens of --kv-cache-space when it starts, so none is ever "
        "preempted",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="KV positions reserved per batch row, prompt + answer (default: the artifact's "
        "context); the batching engine holds max-batch x this many positions in memory",
    )
    p.add_argument(
        "--prefill-stall",
        type=float,
        default=6.0,
        metavar="X",
        help="batching engine: while requests decode, a round prefills only the prompt tokens "
        "whose measured cost keeps the running streams' gap between tokens within X times their "
        "usual gap (default 6; 0 = a fixed 512 tokens a round, as vLLM's token budget)",
    )
    p.add_argument(
        "--engine",
        choices=["auto", "serial", "batching"],
        default="auto",
        help="serial: one request at a time, any artifact; batching: continuous batching "
        "(shared-KV artifacts); auto picks batching when the artifact supports it",
    )
    add_speculative_options(
        p,
        "decode every request speculatively (a shared-KV artifact: in the batching engine's "
        "rows, see --spec-max-rows; concat: the serial engine; greedy output equals plain "
        "greedy)",
        num_draft_default=None,
    )
    add_suffix_record_option(p)
    p.add_argument(
        "--spec-max-rows",
        type=int,
        default=None,
        help="with --speculative on the batching engine: rows speculate only while at most this "
        "many requests decode (default 1: above that a batched step is cheaper per token)",
    )
    p.add_argument(
        "--spec-max-tokens",
        type=int,
        default=None,
        help="with --speculative on the batching engine: above --spec-max-rows, the decoding "
        "rows verify their drafts together in one run, at the width the step cost measured "
        "when the engine starts favours, with rows x (1 + drafts) at most this (default 24: 16 rows decode plainly; "
        "0 turns it off)",
    )
    p.add_argument(
        "--model-name",
        help="the model id clients send and /v1/models lists (default: the directory name)",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a jinja chat template for /v1/chat/completions (for models published without "
        "one, or to replace theirs)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("SPECPORT_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1/* (default: $SPECPORT_API_KEY; unset = open)",
    )
    p.add_argument(
        "--allowed-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="allow browser calls (CORS) from ORIGIN (repeatable; '*' = any); CORS is off otherwise",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=8 * 1024 * 1024, help="largest request body (413)"
    )
    p.add_argument(
        "--client-timeout",
        type=float,
        default=30.0,
        help="seconds a client may take to send its body (408) or to take each piece of an "
        "answer (then it is dropped and its request cancelled)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on Ctrl-C / SIGTERM, seconds requests in flight get to finish; those still running "
        "then get a 503 error (SSE: an error event) and the server exits 0",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="new tokens per request: the default for requests that give no max_tokens, and the "
        "most one may ask for (more is refused with 400); default: OpenAI's (16 for "
        "/v1/completions, the rest of the context for chat) and no cap",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        metavar="N",
        help="requests waiting for a KV row; beyond this new ones get 503 with Retry-After and "
        "/ready answers 503 (default 256)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds a request may take, queueing included; then it is cancelled and answered "
        "504 (a stream: an error event) (default: none)",
    )
    p.add_argument("--no-access-log", action="store_true", help="no log line per request on stderr")
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve with Ray Serve: this many replicas, each with its own engine (pip install "
        "'specport[ray]'); --min-replicas/--max-replicas turn on autoscaling",
    )
    p.add_argument("--min-replicas", type=int, default=None, help="autoscaling lower bound (Ray)")
    p.add_argument("--max-replicas", type=int, default=None, help="autoscaling upper bound (Ray)")
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"url", "model", "engine"} as one JSON line on stdout once serving',
    )
    p.set_defaults(run=run)


def kv_space_bytes(args: argparse.Namespace) -> int | None:
    """--kv-cache-space in bytes (None: the engine's default)."""
    space = getattr(args, "kv_cache_space", None)
    return None if space is None else int(space * 2**30)


def _check(args: argparse.Namespace) -> None:
    check_speculative(args)
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must be in 0..65535, got {args.port}")
    if args.max_batch is not None and args.max_batch < 1:
        raise InputError(f"--max-batch must be at least 1, got {args.max_batch}")
    if args.kv_cache_space is not None and not args.kv_cache_space > 0:
        raise InputError(
            f"--kv-cache-space must be a positive number of GiB, got {args.kv_cache_space}"
        )
    if args.max_model_len is not None and args.max_model_len < 2:
        raise InputError(f"--max-model-len must be at least 2, got {args.max_model_len}")
    if args.num_draft is not None and args.num_draft < 1:
        raise InputError(f"--num-draft must be at least 1, got {args.num_draft}")
    if args.spec_max_rows is not None and args.spec_max_rows < 0:
        raise InputError(f"--spec-max-rows must be 0 or more, got {args.spec_max_rows}")
    if args.spec_max_tokens is not None and args.spec_max_tokens < 0:
        raise InputError(f"--spec-max-tokens must be 0 or more, got {args.spec_max_tokens}")
    if args.max_body_bytes < 1024:
        raise InputError(f"--max-body-bytes must be at least 1024, got {args.max_body_bytes}")
    if args.client_timeout <= 0 or args.drain_timeout < 0:
        raise InputError("--client-timeout must be positive and --drain-timeout not negative")
    if args.prefill_stall != 0 and not args.prefill_stall > 1:
        raise InputError(
            f"--prefill-stall must be above 1 (or 0 for a fixed budget), got {args.prefill_stall}"
        )
    if args.max_tokens is not None and args.max_tokens < 1:
        raise InputError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.max_queue < 1:
        raise InputError(f"--max-queue must be at least 1, got {args.max_queue}")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise InputError(f"--request-timeout must be positive, got {args.request_timeout}")
    if args.api_key is not None and not args.api_key.strip():
        raise InputError("--api-key is empty; give a key, or leave it out to serve without one")


def settings_from(args: argparse.Namespace) -> Any:
    from specport.runtime.serve.state import ServeSettings

    template = None
    if args.chat_template:
        path = Path(args.chat_template)
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(
                f"cannot read --chat-template {path}: {getattr(e, 'strerror', None) or e}; "
                "give a jinja template file"
            ) from None
    return ServeSettings(
        model_name=args.model_name,
        chat_template=template,
        api_key=args.api_key,
        cors_origins=tuple(args.allowed_origin),
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.client_timeout,
        send_timeout_s=args.client_timeout,
        max_tokens=args.max_tokens,
        max_queue=args.max_queue,
        request_timeout_s=args.request_timeout,
    )


def run(args: argparse.Namespace) -> int:
    _check(args)
    settings = settings_from(args)
    if not args.no_access_log:
        logging.getLogger("specport.serve.access").setLevel(logging.INFO)
    if args.replicas is not None or args.min_replicas is not None or args.max_replicas is not None:
        from specport.ray_serve import serve_with_ray  # Ray is optional and slow to import

        return serve_with_ray(args, settings, emit_json)
    return _serve_local(args, settings)


def _serve_local(args: argparse.Namespace, settings: Any) -> int:
    from specport.commands._speculative import load_model, start_recording
    from specport.runtime.engine import make_engine
    from specport.runtime.serve.app import make_app
    from specport.runtime.serve.server import Server

    model, record_largest = load_model(args)
    engine = make_engine(
        model,
        max_batch=args.max_batch,
        kind=args.engine,
        max_length=args.max_model_len,
        speculative=args.speculative,
        num_draft=args.num_draft,
        draft=args.draft,
        spec_max_rows=args.spec_max_rows,
        spec_max_tokens=args.spec_max_tokens,
        kv_space=kv_space_bytes(args),
        prefill_stall=args.prefill_stall or None,
        preemption=args.preemption_mode,
    )
    recorder = start_recording(model, args, record_largest)
    try:
        app = make_app(model, engine, settings)
        try:
            server = Server(app, args.host, args.port, drain_s=args.drain_timeout)
        except OSError as e:
            raise InputError(
                f"cannot listen on {args.host}:{args.port}: {e.strerror or e}; "
                "pick another --port (0 = any free port) or stop what uses it"
            ) from None
        state = app.state.specport
        info: dict[str, Any] = {
            "url": server.url,
            "model": state.served.name,
            "engine": type(engine).__name__,
            "provider": model.provider,
            "chat_template": state.chat_template is not None,
            "max_model_len": state.served.context_length,
        }
        if args.json:
            emit_json(info)
            sys.stdout.flush()
        print(
            f"serving {info['model']} at {info['url']}/v1 ({info['engine']}, {info['provider']}, "
            f"chat template: {'yes' if info['chat_template'] else 'no'}, "
            f"API key: {'required' if settings.api_key else 'none'}); Ctrl-C to stop",
            file=sys.stderr,
            flush=True,
        )
        # uvicorn catches SIGINT / SIGTERM, drains, then re-raises the signal to the handler it
        # found: make that a KeyboardInterrupt for both (even when a shell started us with
        # SIGINT ignored), so either signal ends here with exit 0.
        previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            print("shutting down", file=sys.stderr, flush=True)
            server.sock.close()
    finally:
        engine.close()
        if recorder is not None:
            recorder.close()
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
