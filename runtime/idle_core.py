"""Whether the machine has a core that no other process wants: the auto spin policy's signal.

onnxruntime's pool threads spin between ops; that pays with a core to spare and costs ~2x when
other work competes for the cores (runtime/session.py). What matters is other processes'
runnable work at the moment the session is opened, never this process's own.

Why not the 1-minute load average (what the policy used before, and still does off Linux): it
counts this process's own recent work. A `specport bench` or `quantize` that just exported,
quantized or ran peers in the same process can push it past cores - 1 by itself, and the next
session then did not spin on an otherwise idle 2-core machine (decode 26-35% slower at batch 1). It
cannot be corrected for our share: the kernel keeps only this process's cumulative CPU time,
not its last minute, and a lifetime average misjudges a process that idled and then worked (a
notebook). It also lags a minute both ways: it still counts a job that ended and has not yet
counted one that started.

What is used (Linux): the number of runnable threads on the machine (the 4th field of
/proc/loadavg, which counts the reading thread too) minus this process's own runnable threads
(state R in /proc/self/task/*/stat), sampled SAMPLES times GAP_S apart (~35 ms), and the
median taken. A CPU-bound competitor is runnable in every sample whether or not it holds a core
(measured: a child with 2 spinning threads read 2 in 16 of 16 samples; 2 spinning threads of our
own read 0). The median, not the mean: with one steady competitor thread on 2 cores (exactly at
the threshold) 2 of 16 samples caught some other thread's brief wake-up, and the mean (1.12)
flipped the answer; a competitor runnable in over half the samples still counts. One that sleeps through most of them is missed, and the session spins
beside it. Reading the samples takes ~35 ms at session creation, ~1.5 ms of it CPU (~16 ms in a
process with 60 threads: each sample lists them, unless nothing but the reader runs). Where /proc
cannot be read the load-average rule is kept.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Sequence

logger = logging.getLogger(__name__)

SAMPLES = 16
GAP_S = 0.002
LOADAVG = "/proc/loadavg"
OWN_TASKS = "/proc/self/task"

# (runnable threads on the machine, runnable threads of this process) at one moment
Sample = tuple[int, int]


def machine_has_idle_core() -> bool:
    """True when other processes' runnable work leaves at least one core free (spinning then
    pays); this process's own threads never count. Takes ~35 ms (see the module docstring)."""
    cores = os.cpu_count() or 1
    samples = sample_runnable()
    if samples is None:
        return load_leaves_idle_core(cores)
    others = others_runnable(samples)
    idle = leaves_idle_core(others, cores)
    logger.debug(
        "other runnable threads %.1f (median of %d samples), %d cores, load average %s: idle core %s",
        others,
        len(samples),
        cores,
        _load1(),
        idle,
    )
    return idle


def leaves_idle_core(others: float, cores: int) -> bool:
    """True when `others` runnable threads of other processes leave a core free."""
    return others + 1.0 <= cores


def others_runnable(samples: Sequence[Sample]) -> float:
    """Runnable threads of other processes (machine total minus our own), the median over
    `samples`."""
    if not samples:
        return 0.0
    return float(statistics.median(max(0, total - own) for total, own in samples))


def sample_runnable(samples: int = SAMPLES, gap_s: float = GAP_S) -> list[Sample] | None:
    """`samples` (machine, own) runnable-thread counts `gap_s` apart; None off Linux or where
    /proc cannot be read."""
    out: list[Sample] = []
    try:
        for i in range(samples):
            with open(LOADAVG) as f:
                total = machine_runnable(f.read())
            # only the reader runnable: nothing of anyone else's (and no threads to list)
            out.append((total, total if total <= 1 else own_runnable()))
            if i + 1 < samples:
                time.sleep(gap_s)
    except (OSError, ValueError, IndexError):
        return None
    return out


def machine_runnable(loadavg: str) -> int:
    """Runnable threads on the machine from /proc/loadavg's text ("0.44 1.38 1.71 3/118 31014":
    3, the reader included)."""
    return int(loadavg.split()[3].split("/")[0])


def own_runnable() -> int:
    """This process's threads in state R (running or waiting for a core), the caller included."""
    n = 0
    for tid in os.listdir(OWN_TASKS):
        try:
            with open(f"{OWN_TASKS}/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended between listing and reading
            continue
        n += thread_runnable(stat)
    return n


def thread_runnable(stat: str) -> bool:
    """Whether a /proc/<pid>/task/<tid>/stat line is in state R. The state follows the command
    name in parentheses, which may itself contain spaces and parentheses."""
    return stat[stat.rindex(")") + 2] == "R"


def load_leaves_idle_core(cores: int) -> bool:
    """The fallback off Linux: the 1-minute load average (our own work included) leaves a core
    free; True where there is no load average either."""
    load = _load1()
    return True if load is None else leaves_idle_core(load, cores)


def _load1() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None
