"""tests/pace.py's Contention: CPU that processes older than the block used counts as
taken from the test."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

import pace

_BUSY = [sys.executable, "-c", "while True: pass"]


def test_a_busy_process_that_was_there_before_counts_as_others() -> None:
    hog = subprocess.Popen(_BUSY)
    try:
        time.sleep(0.2)  # running before the block begins
        measured = psutil.Process(hog.pid)
        before = sum(measured.cpu_times()[:2])
        with pace.Contention() as contention:
            time.sleep(1.0)
        used = sum(measured.cpu_times()[:2]) - before
    finally:
        hog.kill()
        hog.wait()
    assert used > 0.05, "the busy loop got no CPU at all"
    assert contention.others >= 0.9 * used
    assert contention.slowness > 1.0
    assert "others used" in str(contention)
