"""The auto spin policy's signal: other processes' runnable threads leave a core free or not.

What users rely on: a session opened right after heavy work in the same process (an export, a
quantization, a benchmark's peers) still spins on an otherwise idle machine, since only other
processes' work counts; work of other processes on every core turns spinning off; an explicit
allow_spinning=True/False is never second-guessed; and `describe()` reports the choice the
session was given. The machine running the tests may be loaded by other jobs, so real-process
checks assert only what load cannot change: our own threads are counted as ours, and children
spinning on every core leave none idle.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from specport.runtime import idle_core as I
from specport.runtime.session import SessionConfig, session_options

linux_only = pytest.mark.skipif(not Path(I.LOADAVG).exists(), reason="/proc/loadavg: Linux")


def test_proc_text_is_read_as_the_kernel_writes_it():
    assert I.machine_runnable("0.44 1.38 1.71 3/118 31014\n") == 3
    # the state follows the last ')': a command name may hold spaces and parentheses
    assert I.thread_runnable("4242 (py) S (x) R 1 4242 4242 0 -1")
    assert not I.thread_runnable("4242 (python3) S 1 4242 4242 0 -1")
    assert not I.thread_runnable("4242 (a R b) D 1 4242 4242 0 -1")


def test_own_work_never_counts_as_other_work():
    # 2 busy threads of ours plus the reader: the machine counts 3; after a minute of it the
    # 1-minute load average reads ~2, and the old rule (load + 1 <= cores) said "no idle core"
    ours_only = [(3, 3)] * 16
    assert not I.leaves_idle_core(2.0, cores=2)
    assert I.others_runnable(ours_only) == 0.0
    assert I.leaves_idle_core(I.others_runnable(ours_only), cores=2)
    # the same machine count with two threads of another process: no idle core
    two_others = [(3, 1)] * 16
    assert I.others_runnable(two_others) == 2.0
    assert not I.leaves_idle_core(I.others_runnable(two_others), cores=2)


def test_a_few_blips_do_not_decide_but_a_steady_competitor_does():
    # one steady other thread on 2 cores, plus two samples that caught a daemon waking up
    steady = [(2, 1)] * 14 + [(3, 1)] * 2
    assert I.others_runnable(steady) == 1.0 and I.leaves_idle_core(1.0, cores=2)
    # two other threads runnable in 10 of 16 samples: counted
    bursty = [(3, 1)] * 10 + [(1, 1)] * 6
    assert not I.leaves_idle_core(I.others_runnable(bursty), cores=2)
    assert I.others_runnable([]) == 0.0


@contextmanager
def _own_busy_threads(n: int) -> Iterator[None]:
    """`n` threads of this process hashing (hashlib lets go of the GIL: they run in parallel)."""
    block = b"x" * (1 << 20)
    stop = threading.Event()

    def burn() -> None:
        while not stop.is_set():
            hashlib.sha256(block).digest()

    threads = [threading.Thread(target=burn) for _ in range(n)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join()


@linux_only
def test_our_busy_threads_are_counted_as_ours():
    with _own_busy_threads(2):
        time.sleep(1.0)  # a while of own work, as before a session is opened in a bench
        samples = I.sample_runnable()
    assert samples is not None and len(samples) == I.SAMPLES
    # the reader and both burners are runnable (on a core or waiting for one) in every sample
    assert statistics.median(own for _, own in samples) >= 3
    assert all(total >= own for total, own in samples)


@contextmanager
def _children_on_every_core() -> Iterator[list[subprocess.Popen[bytes]]]:
    cores = os.cpu_count() or 1
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and not all(_runnable(p.pid) for p in procs):
            time.sleep(0.05)
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _runnable(pid: int) -> bool:
    try:
        return I.thread_runnable(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return False


@linux_only
def test_other_processes_on_every_core_turn_auto_spinning_off_and_explicit_choices_stay():
    auto = SessionConfig(allow_spinning=None)
    with _children_on_every_core():
        time.sleep(0.3)  # past the interpreters' start-up
        assert not I.machine_has_idle_core()
        assert auto.resolved_spinning() is False
        assert SessionConfig(allow_spinning=True).resolved_spinning() is True
    assert SessionConfig(allow_spinning=False).resolved_spinning() is False
    # decided once: what the session got is what describe() reports once the children are gone
    assert auto.describe()["allow_spinning"] is False
    pytest.importorskip("onnxruntime")
    entries = session_options(auto).get_session_config_entry("session.intra_op.allow_spinning")
    assert entries == "0"
