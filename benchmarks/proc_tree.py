"""A server's CPU seconds and resident memory, its child processes included (not a test).

    python -m benchmarks.proc_tree cpu PID     # user + system CPU seconds of PID and its descendants
    python -m benchmarks.proc_tree rss PID     # sample their summed RSS every 0.25 s; on SIGINT or
                                               # when PID exits, print the largest in MB

A server's own /proc entry undercounts a server that works in children: vLLM runs its engine in
an EngineCore process, which does the model's arithmetic. Children that exited are not counted
(a server's workers live as long as it does).
"""

from __future__ import annotations

import argparse
import signal
import time

import psutil


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def cpu_seconds(pid: int) -> float:
    total = 0.0
    for p in _tree(pid):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def rss_bytes(pid: int) -> int:
    total = 0
    for p in _tree(pid):
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("what", choices=["cpu", "rss"])
    ap.add_argument("pid", type=int)
    args = ap.parse_args(argv)
    if args.what == "cpu":
        print(f"{cpu_seconds(args.pid):.2f}")
        return
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    largest = 0
    while not stop and psutil.pid_exists(args.pid):
        largest = max(largest, rss_bytes(args.pid))
        time.sleep(0.25)
    print(f"{largest / 2**20:.0f}")


if __name__ == "__main__":
    main()
