"""`GET /metrics`: Prometheus metrics under the names dashboards already use for vLLM.

Per-request figures (TTFT, inter-token latency, end-to-end time, token counts, finish reasons)
are observed by the app from each request's events (`RequestRecord`); engine figures (requests
running / waiting, KV rows in use, prefix-cache queries and hits, speculative drafted / accepted
tokens) are read from `engine.stats()` at scrape time by a custom collector, so the engine's hot
loop never touches prometheus_client. Every app has its own registry (several apps may live in
one process: tests, Ray replicas on one node).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specport.runtime.engine.base import Event

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0)  # fmt: skip


@dataclass
class RequestRecord:
    """One request's timing and counts, filled from its events as they arrive."""

    request_id: str
    route: str
    prompt_tokens: int
    n: int = 1
    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    completion_tokens: int = 0
    finish: str | None = None
    gaps: list[float] = field(default_factory=list)  # seconds per token after the first

    def observe(self, ev: Event) -> None:
        now = time.perf_counter()
        if ev.token_ids:
            if self.first is None:
                self.first = now
                if len(ev.token_ids) > 1:
                    self.gaps.extend([0.0] * (len(ev.token_ids) - 1))
            elif self.last is not None:
                self.gaps.extend([(now - self.last) / len(ev.token_ids)] * len(ev.token_ids))
            self.last = now
            self.completion_tokens += len(ev.token_ids)
        if ev.finish_reason is not None and self.finish not in ("error", "cancelled"):
            self.finish = ev.finish_reason

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    def fields(self) -> dict[str, Any]:
        total = time.perf_counter() - self.start
        ttft = self.ttft
        return {
            "id": self.request_id,
            "n": self.n,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_ms": "-" if ttft is None else f"{ttft * 1e3:.1f}",
            "total_ms": f"{total * 1e3:.1f}",
            "finish": self.finish or "-",
        }


class Metrics:
    """The app's Prometheus registry: request-level series plus engine gauges at scrape time."""

    def __init__(self, model_name: str, engine: Any) -> None:
        self.registry = CollectorRegistry()
        # process_resident_memory_bytes, CPU seconds, open fds: what dashboards (and the soak
        # test's memory bound) read, as from any Python service on the default registry.
        ProcessCollector(registry=self.registry)
        labels = ["model_name"]
        self.model = model_name
        r = self.registry
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens.", labels, registry=r
        )
        self.success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between consecutive tokens of a request.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.refused = Counter(
            "specport:requests_refused",
            "Requests answered 503 because the queue was full or the server was draining.",
            labels,
            registry=r,
        )
        self.timed_out = Counter(
            "specport:requests_timed_out",
            "Requests cancelled and answered 504 past the request timeout.",
            labels,
            registry=r,
        )
        r.register(_EngineCollector(model_name, engine))

    def started(self, record: RequestRecord) -> None:
        self.prompt_tokens.labels(self.model).inc(record.prompt_tokens)

    def finished(self, record: RequestRecord) -> None:
        m = self.model
        self.generation_tokens.labels(m).inc(record.completion_tokens)
        self.success.labels(m, _reason(record.finish)).inc()
        if record.ttft is not None:
            self.ttft.labels(m).observe(record.ttft)
        itl = self.itl.labels(m)
        for gap in record.gaps:
            itl.observe(gap)
        self.e2e.labels(m).observe(time.perf_counter() - record.start)

    def scrape(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _reason(finish: str | None) -> str:
    return {"eos": "stop", "context": "length"}.get(finish or "", finish or "abort")


class _EngineCollector:
    """Engine gauges and counters read from `engine.stats()` when Prometheus scrapes."""

    def __init__(self, model_name: str, engine: Any) -> None:
        self.model = model_name
        self.engine = engine

    def describe(self) -> list[Any]:
        return []  # collected lazily: no names are claimed at registration

    def collect(self) -> Iterator[Any]:
        try:
            s = self.engine.stats()
        except Exception:  # noqa: BLE001 - a scrape never fails on a closed engine
            return
        m = [self.model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        running = s.get("running", s.get("active", 0))
        max_batch = s.get("max_batch", 1) or 1
        yield gauge("vllm:num_requests_running", "Requests in the running batch.", running)
        yield gauge(
            "vllm:num_requests_waiting", "Requests waiting for a KV row.", s.get("waiting", 0)
        )
        yield gauge("specport:kv_rows_in_use", "KV rows held by running requests.", running)
        yield gauge("specport:kv_rows", "KV rows the engine holds (max batch).", max_batch)
        if s.get("kv_space_tokens"):  # the batching engine admits by KV space
            usage = s.get("kv_reserved_tokens", 0) / s["kv_space_tokens"]
            doc = "Fraction of the KV space reserved by running requests (1 = full)."
            yield gauge("specport:kv_space_tokens", "KV positions admission may fill.",
                        s["kv_space_tokens"])  # fmt: skip
            yield gauge("specport:kv_reserved_tokens", "KV positions running requests reserve.",
                        s.get("kv_reserved_tokens", 0))  # fmt: skip
            yield gauge("specport:kv_committed_bytes",
                        "Bytes of KV pages the rows hold (running and prefix-cached).",
                        s.get("kv_held_bytes", 0))  # fmt: skip
        else:
            usage, doc = running / max_batch, "Fraction of KV rows in use (1 = full)."
        yield gauge("vllm:kv_cache_usage_perc", doc, usage)
        if "preemptions" in s:  # the batching engine (--preemption-mode recompute preempts)
            yield counter(
                "vllm:num_preemptions",
                "Requests preempted to free KV space (resumed later by recompute).",
                s["preemptions"],
            )
        if "prefix_cache_lookups" in s:
            yield counter(
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                s.get("prompt_tokens", 0),
            )
            yield counter(
                "vllm:prefix_cache_hits",
                "Prompt tokens whose KV came from the prefix cache.",
                s.get("prefix_cache_saved_tokens", 0),
            )
        if "engine_cpu_seconds" in s:  # the batching engine's CPU time, by part
            cpu = CounterMetricFamily(
                "specport:engine_cpu_seconds",
                "Thread CPU seconds of the engine: onnxruntime's decode steps and prompt runs, "
                "the worker's host work, the detokenizing thread (the process's rest: HTTP).",
                labels=["model_name", "part"],
            )
            for part in ("decode_ort", "prefill_ort", "engine_host", "textout"):
                cpu.add_metric([self.model, part], s.get(f"{part}_cpu_seconds", 0.0))
            yield cpu
        if "spec_draft_tokens" in s:
            yield counter(
                "vllm:spec_decode_num_drafts", "Speculative verify steps.", s.get("spec_steps", 0)
            )
            yield counter(
                "vllm:spec_decode_num_draft_tokens", "Drafted tokens.", s["spec_draft_tokens"]
            )
            yield counter(
                "vllm:spec_decode_num_accepted_tokens",
                "Accepted draft tokens.",
                s.get("spec_accepted_tokens", 0),
            )
