"""`specport serve ARTIFACT --port 8000`: an OpenAI-compatible HTTP server until Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from specport.cli import emit_json
from specport.commands.generate import add_runtime_options, add_speculative_options
from specport.errors import InputError


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
        "--max-batch", type=int, default=8, help="most requests decoded together (batching engine)"
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="KV positions reserved per batch row, prompt + answer (default: the artifact's "
        "context); the batching engine holds max-batch x this many positions in memory",
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
        "decode every request speculatively (serial engine, concat-layout artifacts; greedy "
        "output equals plain greedy)",
    )
    p.add_argument(
        "--model-name",
        help="the model id clients send and /v1/models lists (default: the directory name)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"url", "model", "engine"} as one JSON line on stdout once serving',
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specport import api
    from specport.runtime.engine import make_engine
    from specport.runtime.server import make_server

    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must be in 0..65535, got {args.port}")
    if args.max_batch < 1:
        raise InputError(f"--max-batch must be at least 1, got {args.max_batch}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise InputError(f"--max-model-len must be at least 2, got {args.max_model_len}")
    model = api.load(args.artifact, provider=args.provider, threads=args.threads)
    if args.num_draft < 1:
        raise InputError(f"--num-draft must be at least 1, got {args.num_draft}")
    engine = make_engine(
        model,
        max_batch=args.max_batch,
        kind=args.engine,
        max_length=args.max_model_len,
        speculative=args.speculative,
        num_draft=args.num_draft,
        draft=args.draft,
    )
    try:
        try:
            server = make_server(
                model, engine, host=args.host, port=args.port, model_name=args.model_name
            )
        except OSError as e:
            raise InputError(
                f"cannot listen on {args.host}:{args.port}: {e.strerror or e}; "
                "pick another --port (0 = any free port) or stop what uses it"
            ) from None
        info: dict[str, Any] = {
            "url": server.url,
            "model": server.served.name,
            "engine": type(engine).__name__,
            "provider": model.provider,
            "chat_template": server.chat_template is not None,
        }
        if args.json:
            emit_json(info)
            sys.stdout.flush()
        print(
            f"serving {info['model']} at {info['url']}/v1 ({info['engine']}, {info['provider']}, "
            f"chat template: {'yes' if info['chat_template'] else 'no'}); Ctrl-C to stop",
            file=sys.stderr,
            flush=True,
        )
        # SIGTERM (docker, systemd) and SIGINT (even when a shell started us with it ignored)
        previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            print("shutting down", file=sys.stderr, flush=True)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            server.server_close()
    finally:
        engine.close()
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
