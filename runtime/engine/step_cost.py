"""What a batched step costs, measured once per engine, and the verify width that pays most.

Rows verifying together feed a dense [b, w] block of ids (b = rows up to the highest decoding
one, w = 1 + the widest row's drafts): every row pays for w tokens in every MatMul, drafts or
not. On a CPU the run is compute-bound from a handful of tokens on, so its cost grows with the
token count b x w. Measured on SmolLM2-135M (fp32, 2 threads, 2-core machine, load ~4): a
batch-1 step 33 ms, 4 tokens 47-53 ms, 8 tokens 64-72 ms, 16 tokens 96-109 ms, 64 tokens
316-333 ms, close to a line `base + per_token x (tokens - 1)`. `StepCost.calibrate` measures
that line on the engine's own buffers when it starts (three short runs on its free rows), and
`best_width` compares, for each width, the tokens the rows are expected to emit against what
the run costs, plain decoding (width 1) included: a row without drafts, or whose drafts are
rarely accepted, no longer drags the whole step to the widest row's width.

One sequence's step (`verify_costs`) is measured per width instead (batch 1, widths 1..9: the
jump from one token to two, a different attention path, is not on the batched line), once per
machine and artifact: the table is kept in `settings.cache_dir()/step_costs.json`, keyed by
the artifact's file hashes, the provider, the thread count and the CPU, so a second run reads
it instead of measuring (about 40 target runs). The proposers that size their drafts from it
(`speculative.hybrid`) read relative costs: a verify of k drafts costs `verify_costs[k]`
plain steps. That table comes from ~40 runs timed once; a machine that was busy then would
steer every later run. So the hybrid also times its own steps (`LiveVerifyCosts`): once it
has enough plain and verify steps, their ratio corrects the table, and a table that was off
by more than `LIVE_KEEP` is replaced on disk by the corrected one.

Both time the work in **process CPU time** where the graph runs on this process's own threads
(`step_clock`: the CPU provider, OpenVINO), not wall time. On a machine with more runnable
threads than cores, wall time counts the waits for a core, and a verify run, longer than a
plain step, is preempted more often: on SmolLM2-135M (2 threads, 2 cores, load 14-25) the
steps' wall times priced one draft at 4.06 plain steps, while the runs cost 1.08 by wall and
by CPU time timed alone (`benchmarks/verify_cost_clocks.py`). CPU time does not count the
waits. Accelerator providers keep wall time (the work is not on the host's threads). And
nothing measured while the 1-minute load average exceeds the core count (`busy`) is written
to disk: it serves the run that measured it, and the reason is logged.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import logging
import os
import platform
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specport.artifact.manifest import write_text_atomic
from specport.runtime.kv.interface import KVCache

logger = logging.getLogger(__name__)

__all__ = [
    "LiveVerifyCosts",
    "StepCost",
    "best_width",
    "busy",
    "keep_verify_costs",
    "live_verify_costs",
    "machine_load",
    "measure_widths",
    "step_clock",
    "verify_costs",
]

CALIBRATION_TOKENS = (1, 8, 16)  # tokens per calibration run (the first is a plain step)
CALIBRATION_REPEATS = 5  # rounds over every size; each size's fastest run counts


@dataclass
class StepCost:
    """Seconds of one run over `tokens` new tokens in all: base + per_token x (tokens - 1),
    times a scale per kind of run (plain, verify) that the engine's own timed steps correct
    (`observe`): a start-up measurement on a shared machine can be off, the steps it decodes
    are what they are."""

    base: float
    per_token: float
    plain_scale: float = 1.0
    verify_scale: float = 1.0

    def __call__(self, tokens: int) -> float:
        return self.base + self.per_token * max(0, int(tokens) - 1)

    def plain(self, tokens: int) -> float:
        return self.plain_scale * self(tokens)

    def verify(self, tokens: int) -> float:
        return self.verify_scale * self(tokens)

    def observe(self, tokens: int, seconds: float, verify: bool, decay: float = 0.9) -> None:
        """A timed run of `tokens` tokens. Plain steps also pull the verify scale a little
        toward theirs, so a verify cost once measured high is tried again later."""
        ratio = min(max(seconds / self(tokens), 0.25), 4.0)  # a stall is not a trend
        if verify:
            self.verify_scale = decay * self.verify_scale + (1.0 - decay) * ratio
        else:
            self.plain_scale = decay * self.plain_scale + (1.0 - decay) * ratio
            self.verify_scale += 0.02 * (self.plain_scale - self.verify_scale)

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float]]) -> StepCost:
        """Least squares over (tokens, seconds); the slope is never negative."""
        t = np.asarray([s[0] for s in samples], dtype=np.float64) - 1.0
        y = np.asarray([s[1] for s in samples], dtype=np.float64)
        if len(samples) < 2 or float(np.ptp(t)) == 0.0:
            return cls(float(y.mean()), 0.0)
        slope, intercept = (float(v) for v in np.polyfit(t, y, 1))
        if slope < 0.0:  # noise on a machine where more tokens cost nothing more
            return cls(float(y.mean()), 0.0)
        return cls(max(intercept, 1e-6), slope)

    @classmethod
    def calibrate(cls, slots: KVCache, rows: int) -> StepCost:
        """Time a plain batch-1 step and two batched verify runs on free rows [0, rows)
        (their lengths are put back: nothing they cache is kept). Call before any request."""
        start = slots.lengths.copy()
        sizes = [
            (1, 1) if n == 1 else (min(rows, 4), n // min(rows, 4)) for n in CALIBRATION_TOKENS
        ]
        times: dict[tuple[int, int], list[float]] = {size: [] for size in sizes}
        try:
            for repeat in range(CALIBRATION_REPEATS + 1):  # the first round warms up
                for batch, width in sizes:  # interleaved: a load spike hits every size alike
                    slots.lengths[:] = start
                    t0 = time.perf_counter()
                    ids = np.zeros((batch, width), dtype=np.int64)
                    slots.step(ids, np.ones(batch, dtype=bool))
                    if repeat:
                        times[(batch, width)].append(time.perf_counter() - t0)
        finally:
            slots.lengths[:] = start
        # the fastest run of each size: other processes only ever add time (a shared machine)
        samples = [(b * w, min(times[(b, w)])) for b, w in sizes]
        cost = cls.fit(samples)
        logger.info(
            "batched step cost: %.1f ms + %.2f ms per extra token (measured %s)",
            1e3 * cost.base,
            1e3 * cost.per_token,
            ", ".join(f"{n} tokens {1e3 * s:.1f} ms" for n, s in samples),
        )
        return cost


def best_width(
    cost: StepCost,
    batch: int,  # rows the run spans (up to the highest decoding row)
    drafts: Sequence[int],  # drafts each decoding row proposed (0: none)
    expected: Sequence[Sequence[float]],  # per row: expected tokens emitted with 0..d drafts
    max_tokens: int | None = None,  # hard cap on batch x width
) -> int:
    """The run width (1 + drafts per row) with the most expected tokens per second; 1 means
    a plain batched step pays best. `expected[r][k]` is row r's expected tokens when it
    verifies k drafts (`expected[r][0]` = 1)."""
    plain = len(drafts) / cost.plain(batch)
    best_w, best = 1, plain
    for w in range(2, 2 + max(drafts, default=0)):
        if max_tokens is not None and batch * w > max_tokens:
            break
        tokens = sum(e[min(d, w - 1)] for d, e in zip(drafts, expected))
        value = tokens / cost.verify(batch * w)
        if value > best:
            best_w, best = w, value
    return best_w


HOST_PROVIDERS = ("cpu", "openvino")  # run the graph on this process's threads


def step_clock(provider: str | None) -> Callable[[], float]:
    """The clock that times steps for ``provider`` (the short name a session reports, e.g.
    ``cpu``): process CPU time where the work runs on this process's own threads, so waiting
    for a core on a busy machine is not counted as cost (see the module docstring); wall time
    for accelerators, whose work the host's CPU time does not see."""
    name = str(provider or "cpu").lower()
    return time.process_time if name in HOST_PROVIDERS else time.perf_counter


def machine_load() -> tuple[float, int]:
    """(the 1-minute load average, the machine's cores); a load of 0 where the platform has no
    load average."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows
        load = 0.0
    return float(load), int(os.cpu_count() or 1)


def busy(load: float, cores: int) -> str | None:
    """Why timings taken now must not be kept for later runs (None: they may be). Above one
    runnable thread per core a step also waits for a core; a later run on a quieter machine
    would inherit costs that were not the work's."""
    if load > cores:
        return f"the 1-minute load average {load:.1f} exceeds the {cores} cores"
    return None


WIDTHS = (1, 2, 3, 4, 5, 7, 9)  # batch-1 widths measured (1 + drafts)
WIDTH_REPEATS = 5  # rounds over every width; each width's fastest run counts
CONTEXT = 32  # positions already cached when a width is timed (a short chat turn's start)
_MEMO: weakref.WeakKeyDictionary[Any, list[float]] = weakref.WeakKeyDictionary()


def measure_widths(
    session: Any,
    manifest: Any,
    widths: Sequence[int] = WIDTHS,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Seconds of one batch-1 run feeding each of ``widths`` tokens by ``clock`` (the fastest
    of ``WIDTH_REPEATS`` interleaved rounds after a warm-up round: on a shared machine other
    processes only ever add time), on a cache of its own with ``CONTEXT`` positions filled."""
    from specport.core.progress import Stages
    from specport.runtime.kv.cache import open_kv_cache  # the engine's cache, opened here only

    # a second on a small model, up to a minute on an 8B one: say what it is and what it took
    stage = Stages(1)
    stage.start(f"measuring verify costs once for this machine and artifact ({len(widths)} widths)")
    cache = open_kv_cache(session, manifest, 1, CONTEXT + max(widths) + 1)
    live = np.ones(1, dtype=bool)
    cache.step(np.zeros((1, CONTEXT), dtype=np.int64), live)
    times: dict[int, float] = {w: float("inf") for w in widths}
    for repeat in range(WIDTH_REPEATS + 1):
        for w in widths:
            cache.keep(0, CONTEXT)
            t0 = clock()
            cache.step(np.zeros((1, w), dtype=np.int64), live)
            if repeat:
                times[w] = min(times[w], clock() - t0)
    stage.done()
    return [times[w] for w in widths]


def relative_costs(seconds: Sequence[float], widths: Sequence[int], max_draft: int) -> list[float]:
    """Cost of verifying k = 0..max_draft drafts relative to a plain step: the measured widths
    interpolated, costs never decreasing, the last slope extended past the widest width."""
    w = np.asarray(widths, dtype=np.float64)
    s = np.maximum.accumulate(np.asarray(seconds, dtype=np.float64))
    ks = np.arange(max_draft + 1, dtype=np.float64) + 1.0  # widths 1..max_draft+1
    out = np.interp(ks, w, s)
    if len(w) > 1:
        slope = max((s[-1] - s[-2]) / (w[-1] - w[-2]), 0.0)
        past = ks > w[-1]
        out[past] = s[-1] + slope * (ks[past] - w[-1])
    return [float(v) for v in out / max(float(s[0]), 1e-9)]


def verify_costs(
    model: Any,
    max_draft: int = 16,
    load: Callable[[], tuple[float, int]] = machine_load,
) -> list[float]:
    """What verifying k = 0..max_draft drafts costs relative to a plain step on this machine
    for ``model`` (a loaded ``specport.api.Model``, or anything with ``session`` and
    ``manifest``): measured once per machine and artifact and kept on disk (see the module
    docstring) unless ``load()`` finds the machine oversubscribed (``busy``), once per loaded
    model in memory."""
    with contextlib.suppress(TypeError):
        if model in _MEMO:
            return _extend(_MEMO[model], max_draft)
    key = _key(model)
    table = _read(key) if key else None
    if table is None:
        clock = step_clock(_provider(model))
        seconds = measure_widths(model.session, model.manifest, WIDTHS, clock)
        table = {"widths": list(WIDTHS), "seconds": seconds}
        logger.info(
            "verify cost per width (batch 1, %s): %s",
            _clock_name(clock),
            ", ".join(f"{w}: {1e3 * t:.1f} ms" for w, t in zip(WIDTHS, seconds)),
        )
        why = busy(*load())
        if why:
            logger.info("verify costs not kept for later runs: %s", why)
        elif key:
            _write(key, table)
    costs = relative_costs(table["seconds"], table["widths"], 16)
    with contextlib.suppress(TypeError):
        _MEMO[model] = costs
    return _extend(costs, max_draft)


def keep_verify_costs(model: Any, costs: Sequence[float]) -> None:
    """Replace ``model``'s kept verify costs (``costs[k]``: verifying k drafts, a plain step
    being 1) in memory and on disk: what the next run on this machine starts from."""
    costs = [float(c) for c in costs]
    with contextlib.suppress(TypeError):
        _MEMO[model] = costs
    key = _key(model)
    if key:
        widths = list(range(1, len(costs) + 1))
        _write(key, {"widths": widths, "seconds": costs, "from": "decoding"})


LIVE_WINDOW = 64  # the latest timed steps kept per draft count
LIVE_MIN = 16  # timed steps of a draft count, and of plain steps, before they correct its cost
LIVE_EVERY = 32  # timed steps between corrections
LIVE_KEEP = 0.10  # a draft count's cost this far off the kept table replaces it on disk
LIVE_NEAR = 8  # plain steps nearest a verify step's context that give its plain step's time
PROBE_EVERY = 16  # timed steps between probes while one-draft verifies are too few to judge


class LiveVerifyCosts:
    """Verify costs corrected by the steps decoding times itself.

    ``verify_costs`` keeps a table timed once in ~40 runs: measured while other work held the
    cores, it is off for good (a tiny model's 2-token verify read 1.3 plain steps under load
    and 1.0 idle). Decoding times hundreds of steps of each kind: per draft count k, the lower
    quartile of its latest steps' times (verify run and host work; stalls only add time), each
    over a plain step's at the same context, is what verifying k drafts costs now. A step's
    cost grows with the context it attends over, and drafts come where text repeats, in long
    prompts more than short ones: on Spec-Bench (SmolLM2, 14 requests) `auto`'s plain steps
    averaged 256 tokens of context and its 3-draft steps 800, and against all plain steps
    3 drafts cost 1.71 plain steps, against those nearest in context 1.47 (the graph runs
    alone, 1.17-1.28). So a verify step's plain time is the lower quartile of the
    ``LIVE_NEAR`` plain steps nearest its context (ties included: callers that give no context
    compare with every plain step). Each count measured corrects its own cost, counts never
    drafted take the factor of the nearest measured one, and costs stay non-decreasing. When
    a measured count is off the kept table by more than ``LIVE_KEEP``, ``keep`` stores the
    corrected table (``keep_verify_costs``), so the next run starts right, unless ``load()``
    says the machine is oversubscribed (``busy``): then the correction serves this process
    only and the reason is logged.

    Callers time their steps with ``clock`` (``step_clock``: process CPU time on the CPU
    provider), never with a clock of their own: every ratio here is between steps timed alike.

    A table that prices drafts too high stops them, and with them the steps that would show
    it: so while fewer than ``LIVE_MIN`` one-draft verifies were timed, ``probe`` asks for one
    every ``PROBE_EVERY`` steps (a free draft at hand, a suffix match, is verified though the
    table says it does not pay; under greedy decoding a draft changes speed, never tokens).
    """

    def __init__(
        self,
        costs: Sequence[float],
        keep: Callable[[list[float]], None] | None = None,
        clock: Callable[[], float] = time.process_time,
        load: Callable[[], tuple[float, int]] = machine_load,
    ) -> None:
        self.table = [float(c) for c in costs]  # what the corrections scale
        self.costs = list(self.table)  # the corrected costs now
        self._kept = list(self.table)  # what the disk holds
        self._keep = keep
        self.clock = clock  # what the steps fed to ``observe`` are timed with
        self._load = load  # (1-minute load average, cores) when a correction would be kept
        self.unkept: str | None = None  # why the last correction off the disk was not kept
        self._times: dict[int, deque[tuple[float, int]]] = {}  # (seconds, context) per count
        self._since = 0
        self.steps = 0  # timed steps seen
        self._probed = 0  # ``steps`` at the last probe

    def probe(self) -> bool:
        """Whether to verify one draft now that the costs say not to (see the class doc)."""
        if len(self._times.get(1, ())) >= LIVE_MIN or self.steps - self._probed < PROBE_EVERY:
            return False
        self._probed = self.steps
        return True

    def observe(self, drafts: int, seconds: float, context: int = 0) -> bool:
        """One timed step that verified ``drafts`` drafts (0: a plain step) over ``context``
        tokens before it; True when the costs changed."""
        if seconds <= 0.0 or drafts >= len(self.table):
            return False
        times = self._times.setdefault(int(drafts), deque(maxlen=LIVE_WINDOW))
        times.append((float(seconds), int(context)))
        self.steps += 1
        self._since += 1
        if self._since < LIVE_EVERY:
            return False
        self._since = 0
        return self._correct()

    def _correct(self) -> bool:
        plain = self._times.get(0, ())
        if len(plain) < LIVE_MIN:
            return False
        base = _PlainAt(plain)
        factors = {
            k: lower_quartile([s / base(c) for s, c in t]) / self.table[k]
            for k, t in self._times.items()
            if k > 0 and len(t) >= LIVE_MIN
        }
        if not factors:
            return False
        measured = sorted(factors)
        costs = [1.0]
        for k in range(1, len(self.table)):
            near = min(measured, key=lambda m: (abs(m - k), m))  # ties: the smaller count
            costs.append(max(costs[-1], self.table[k] * factors[near]))
        changed = any(abs(c - o) > 0.01 * o for c, o in zip(costs, self.costs))
        self.costs = costs
        if changed:
            logger.info(
                "verify costs from %d timed steps: %s",
                self.steps,
                ", ".join(f"{k} drafts {self.table[k]:.2f} -> {costs[k]:.2f}" for k in measured),
            )
        off = max(abs(costs[k] / self._kept[k] - 1.0) for k in measured)
        if off > LIVE_KEEP and self._keep is not None:
            why = busy(*self._load())
            if why is None:
                self._keep(list(costs))
                self._kept = list(costs)
            elif why != self.unkept:  # said once per reason, not every correction
                logger.info("corrected verify costs not kept for later runs: %s", why)
            self.unkept = why
        return changed


class _PlainAt:
    """A plain step's seconds at a context: the lower quartile of the ``LIVE_NEAR`` timed plain
    steps nearest it in context, ties included (``LiveVerifyCosts``)."""

    def __init__(self, plain: Sequence[tuple[float, int]] | deque[tuple[float, int]]) -> None:
        steps = sorted(plain, key=lambda sc: sc[1])
        self._seconds = [s for s, _ in steps]
        self._contexts = [c for _, c in steps]
        self._memo: dict[int, float] = {}

    def __call__(self, context: int) -> float:
        if context not in self._memo:
            ctx, n = self._contexts, len(self._contexts)
            lo = hi = bisect.bisect_left(ctx, context)  # the window is ctx[lo:hi]
            while hi - lo < min(LIVE_NEAR, n):  # widen toward the nearer side
                if hi < n and (lo == 0 or ctx[hi] - context <= context - ctx[lo - 1]):
                    hi += 1
                else:
                    lo -= 1
            far = max(context - ctx[lo], ctx[hi - 1] - context)
            while lo > 0 and context - ctx[lo - 1] <= far:
                lo -= 1
            while hi < n and ctx[hi] - context <= far:
                hi += 1
            self._memo[context] = lower_quartile(self._seconds[lo:hi])
        return self._memo[context]


def lower_quartile(values: Sequence[float] | deque[float]) -> float:
    """``np.quantile(values, 0.25)`` (its default linear interpolation, its rounding) in plain
    Python: a correction runs between two decode steps, where numpy's quantile cost 40-110 us
    a call and its first call in a process 7.8 ms (measured 2026-12-06, 2-core AVX2 machine
    at load ~4), against a few microseconds to sort 64 floats."""
    s = sorted(values)
    pos = 0.25 * (len(s) - 1)
    lo = int(pos)
    t = pos - lo
    if t == 0.0:
        return float(s[lo])
    a, b = float(s[lo]), float(s[lo + 1])
    diff = b - a
    return b - diff * (1.0 - t) if t >= 0.5 else a + diff * t


_LIVE: weakref.WeakKeyDictionary[Any, LiveVerifyCosts] = weakref.WeakKeyDictionary()


def _keeper(model: Any) -> Callable[[list[float]], None]:
    """Stores corrected verify costs for ``model`` (``keep_verify_costs``) without keeping it
    alive."""
    ref = weakref.ref(model)

    def keep(costs: list[float]) -> None:
        held = ref()
        if held is not None:
            keep_verify_costs(held, costs)

    return keep


def live_verify_costs(model: Any) -> LiveVerifyCosts:
    """``model``'s verify costs with the tracker that corrects them from timed steps, one per
    loaded model (``auto`` and the adaptive draft length share it): a table that prices drafts
    out is found out only after ``LIVE_MIN`` probes, more than one answer's worth, so the
    tracker outlives a call."""
    with contextlib.suppress(TypeError):
        if model in _LIVE:
            return _LIVE[model]
    try:
        keep: Callable[[list[float]], None] | None = _keeper(model)
    except TypeError:  # not weakly referenceable: corrections stay in this tracker
        keep = None
    live = LiveVerifyCosts(verify_costs(model), keep, step_clock(_provider(model)))
    with contextlib.suppress(TypeError):
        _LIVE[model] = live
    return live


def _extend(costs: list[float], max_draft: int) -> list[float]:
    if max_draft < len(costs):
        return costs[: max_draft + 1]
    slope = costs[-1] - costs[-2] if len(costs) > 1 else 0.0
    return costs + [costs[-1] + slope * (i + 1) for i in range(max_draft + 1 - len(costs))]


def _provider(model: Any) -> str | None:
    """The provider ``model``'s session runs on: its short name, else the session's first."""
    name = getattr(model, "provider", None)
    if name:
        return str(name)
    with contextlib.suppress(AttributeError, IndexError, TypeError):
        return str(model.session.get_providers()[0]).removesuffix("ExecutionProvider")
    return None


def _clock_name(clock: Callable[[], float]) -> str:
    return "process CPU time" if clock is time.process_time else "wall time"


def _key(model: Any) -> str | None:
    """The cache key: the artifact's file hashes, provider, threads, the machine's CPU and the
    clock (tables timed by another clock are not comparable); None for a model without files
    (nothing to key a measurement by)."""
    files = getattr(model.manifest, "files", None)
    if not files or getattr(model, "path", None) is None:
        return None
    config = getattr(model, "session_config", None)
    parts = {
        "files": sorted(files.items()),
        "clock": _clock_name(step_clock(_provider(model))),
        "provider": str(getattr(model, "provider", "")),
        "threads": getattr(config, "intra_op_threads", None),
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        # 2: tables kept before may hold verify steps timed while a draft model's thread pool
        # spun beside them (before sessions stopped spinning between runs): SmolLM2's kept
        # table priced one draft at 1.84 plain steps, measured 1.03-1.10, and draft decoding
        # never drafted to correct it; 3: corrections priced verify steps against plain steps
        # of any context (Spec-Bench: 3 drafts at 1.71 plain steps, 1.47 at their context)
        "timing": 3,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _path() -> Path:
    from specport.core.settings import cache_dir

    return cache_dir() / "step_costs.json"


def _read(key: str) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError, TypeError):
        entry = json.loads(_path().read_text()).get(key)
        if entry and len(entry["widths"]) == len(entry["seconds"]) >= 2:
            return dict(entry)
    return None


def _write(key: str, table: dict[str, Any]) -> None:
    """Add ``table`` under ``key``, written atomically (``write_text_atomic``: a crash leaves the
    old file or the new one and no temp file); a failure only costs a later re-measure."""
    path = _path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        data[key] = table
        write_text_atomic(path, json.dumps(data))
    except OSError as exc:
        logger.debug("could not keep the step costs in %s: %s", path, exc)
