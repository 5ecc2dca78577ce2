"""Scale out on Ray Serve: the same FastAPI app (`make_app`) in N replicas behind one endpoint.

`specport serve ARTIFACT --replicas N` (or `--min-replicas A --max-replicas B` for autoscaling
on queued requests, as `ray.serve.llm` offers for vLLM) starts a local Ray instance bound to
127.0.0.1 (or joins `RAY_ADDRESS`), and deploys `SpecportReplica`: each replica loads the
artifact, owns one engine with its own onnxruntime threads, and serves `make_app`'s app through
`@serve.ingress` (late-bound: the app is built in the replica). Ray's HTTP proxy spreads
requests over the replicas; a replica that dies fails only the requests it held, and Ray starts
a new one. Ray is optional: `pip install 'specport[ray]'`.

It sits with the API, not in the runtime: each replica loads its artifact (`specport.api.load`).

From Python (e.g. `serve run`-style deployment in an existing cluster):

    from specport.ray_serve import deployment
    serve.run(deployment("out/model", replicas=2).bind(), route_prefix="/")
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specport.core.errors import InputError
from specport.loading import load
from specport.runtime.engine import make_engine
from specport.runtime.engine.admission import DEFAULT_PREEMPTION
from specport.runtime.engine.prefill_pace import STALL as PREFILL_STALL
from specport.runtime.serve.app import make_app
from specport.runtime.serve.state import ServeSettings
from specport.runtime.speculative.suffix_record import (
    SuffixRecorder,
    check_record,
    corpus_to_read,
)

logger = logging.getLogger(__name__)


def _require_ray() -> Any:
    try:
        from ray import serve
    except ImportError:
        raise InputError(
            "--replicas needs Ray Serve: pip install 'specport[ray]' (or serve without --replicas)"
        ) from None
    return serve


class SpecportReplica:
    """One replica: a loaded artifact, its engine, and the app over them."""

    def __init__(
        self,
        artifact: str,
        settings: ServeSettings,
        engine_options: dict[str, Any],
        provider: str = "auto",
        threads: int = 1,
        suffix_corpus: str | None = None,
        suffix_record: str | None = None,
    ) -> None:

        # (Ray's ASGI wrapper owns `app`; ours go under other names)
        self.specport_model = load(
            artifact,
            provider=provider,
            threads=threads,
            mtp_branch=engine_options.get("speculative") == "mtp",
            suffix_corpus=corpus_to_read(suffix_corpus, suffix_record),
        )
        self.specport_engine = make_engine(self.specport_model, **engine_options)
        self.specport_recorder = (  # every replica appends its answers to the one file
            None
            if suffix_record is None
            else SuffixRecorder.attach(
                self.specport_model, suffix_record, check_record(suffix_record)
            )
        )
        self.specport_app = make_app(self.specport_model, self.specport_engine, settings)

    def __serve_build_asgi_app__(self) -> Any:
        return self.specport_app

    def __del__(self) -> None:
        engine = getattr(self, "specport_engine", None)
        if engine is not None:
            engine.close()
        recorder = getattr(self, "specport_recorder", None)
        if recorder is not None:
            recorder.close()


def deployment(
    artifact: str,
    settings: ServeSettings | None = None,
    *,
    replicas: int | None = 1,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    threads: int = 1,
    provider: str = "auto",
    engine_options: dict[str, Any] | None = None,
    max_ongoing_requests: int = 64,
    suffix_corpus: str | None = None,
    suffix_record: str | None = None,
) -> Any:
    """A Ray Serve application of `SpecportReplica` (call `.bind()` on it, or see serve_with_ray)."""
    serve = _require_ray()
    options: dict[str, Any] = {
        "name": "specport",
        "ray_actor_options": {"num_cpus": threads},
        "max_ongoing_requests": max_ongoing_requests,
        "health_check_period_s": 2,
        "health_check_timeout_s": 30,
    }
    if min_replicas is not None or max_replicas is not None:
        lo = min_replicas if min_replicas is not None else 1
        hi = max_replicas if max_replicas is not None else max(lo, replicas or 1)
        if not 0 <= lo <= hi or hi < 1:
            raise InputError(
                f"need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1, got {lo}, {hi}"
            )
        options["autoscaling_config"] = {
            "min_replicas": lo,
            "max_replicas": hi,
            "initial_replicas": min(max(replicas or lo, lo), hi),
            "target_ongoing_requests": 8,
        }
    else:
        if replicas is None or replicas < 1:
            raise InputError(f"--replicas must be at least 1, got {replicas}")
        options["num_replicas"] = replicas
    cls = serve.deployment(**options)(serve.ingress()(SpecportReplica))
    return cls.options().bind(
        str(artifact),
        settings or ServeSettings(),
        engine_options or {},
        provider,
        threads,
        None if suffix_corpus is None else str(Path(suffix_corpus).resolve()),
        None if suffix_record is None else str(Path(suffix_record).resolve()),
    )


def start_local_ray(num_cpus: int | None = None) -> None:
    """A local Ray instance on 127.0.0.1 (or the cluster at RAY_ADDRESS), quietly."""
    import ray

    if not ray.is_initialized():
        ray.init(
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            num_cpus=num_cpus,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )


def run_deployment(app: Any, host: str, port: int) -> str:
    """Deploy `app` behind Ray's HTTP proxy on host:port; returns the endpoint URL."""
    serve = _require_ray()
    serve.start(http_options={"host": host, "port": port}, detached=False)
    serve.run(app, name="specport", route_prefix="/", blocking=False)
    return f"http://{host}:{port}"


def serve_with_ray(args: Any, settings: ServeSettings, emit_json: Callable[[Any], None]) -> int:
    """`specport serve --replicas N`: deploy, print the endpoint (`emit_json` under --json),
    block until SIGINT / SIGTERM."""

    serve = _require_ray()
    import ray

    engine_options = {
        "max_batch": args.max_batch,
        "kv_space": None if args.kv_cache_space is None else int(args.kv_cache_space * 2**30),
        "kind": args.engine,
        "max_length": args.max_model_len,
        "speculative": args.speculative,
        "num_draft": args.num_draft,
        "draft": args.draft,
        "spec_max_rows": getattr(args, "spec_max_rows", None),
        "spec_max_tokens": getattr(args, "spec_max_tokens", None),
        "prefill_stall": getattr(args, "prefill_stall", PREFILL_STALL) or None,
        "preemption": getattr(args, "preemption_mode", DEFAULT_PREEMPTION),
    }
    threads = args.threads or 1
    record = getattr(args, "suffix_record", None)
    corpus = corpus_to_read(getattr(args, "suffix_corpus", None), record)
    if corpus is not None and not Path(corpus).is_file():  # before Ray starts, not in a replica
        raise InputError(f"--suffix-corpus {corpus}: no such file.")
    if record is not None:
        check_record(record)
    app = deployment(
        args.artifact,
        settings,
        replicas=args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        threads=threads,
        provider=args.provider,
        engine_options=engine_options,
        suffix_corpus=corpus,
        suffix_record=record,
    )
    start_local_ray()
    try:
        port = args.port or 8000
        url = run_deployment(app, args.host, port)
        info = {"url": url, "model": settings.model_name, "replicas": args.replicas}
        if args.json:
            emit_json(info)
            sys.stdout.flush()
        print(f"serving at {url}/v1 on Ray Serve; Ctrl-C to stop", file=sys.stderr, flush=True)
        stop = threading.Event()
        previous = {
            s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            while not stop.wait(0.5):
                pass
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        print("shutting down", file=sys.stderr, flush=True)
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0
