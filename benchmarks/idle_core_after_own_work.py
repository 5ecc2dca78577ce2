"""The auto spin policy right after this process worked: the old rule against the new one.

    python -m benchmarks.idle_core_after_own_work [--seconds 40] [--threads 2]

Burns `--threads` threads of this process (hashlib on 1 MB blocks, which releases the GIL)
for `--seconds`, then prints the 1-minute load average, what the old rule (load average + 1 <=
cores, which counts our own work) and the new one (other processes' runnable threads,
runtime/idle_core.py) answer, the samples behind the new one and what reading them cost in
CPU time. Counts, not timings: run it nice'd beside anything.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import threading
import time

from specport.runtime import idle_core

BLOCK = b"x" * (1 << 20)


def burn(stop: threading.Event) -> None:
    while not stop.is_set():
        hashlib.sha256(BLOCK).digest()


def report(label: str) -> None:
    cores = os.cpu_count() or 1
    cpu0 = time.process_time()
    samples = idle_core.sample_runnable()
    cpu_ms = (time.process_time() - cpu0) * 1e3
    old = idle_core.load_leaves_idle_core(cores)
    if samples is None:
        print(f"{label}: no /proc samples here; old rule idle core {old}", flush=True)
        return
    others = idle_core.others_runnable(samples)  # as machine_has_idle_core decides
    print(
        f"{label}: load average {os.getloadavg()[0]:.2f}, cores {cores}; "
        f"old rule idle core {old}; "
        f"new rule idle core {idle_core.leaves_idle_core(others, cores)} "
        f"(other runnable {others:.1f}; samples (machine, own) {samples}; "
        f"{cpu_ms:.1f} ms CPU to read them)",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    report("before")
    stop = threading.Event()
    threads = [threading.Thread(target=burn, args=(stop,)) for _ in range(args.threads)]
    cpu0 = time.process_time()
    for t in threads:
        t.start()
    time.sleep(args.seconds)
    stop.set()
    for t in threads:
        t.join()
    print(f"burned {time.process_time() - cpu0:.1f} s CPU in {args.threads} threads", flush=True)
    report("right after")


if __name__ == "__main__":
    main()
