"""The benchmarks' process readings (benchmarks/common.py): a server's RSS is its whole
process tree's, children included, read from the tree's own /proc files; a process that is
gone reads as None. Real processes, no model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from benchmarks.common import process_tree, rss_tree_mb

# a child holding 64 MB resident; its parent starts it, then both wait to be killed
CHILD = (
    "b = bytearray(64 << 20)\n"
    "for i in range(0, len(b), 4096): b[i] = 1\n"
    "print('ready', flush=True)\n"
    "import time; time.sleep(60)"
)
PARENT = f"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), child.pid, flush=True)
child.wait()
"""


def test_rss_counts_the_children_and_a_gone_process_reads_none() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        ready, child = parent.stdout.readline().split()
        assert ready == "ready"
        assert process_tree(parent.pid) == [parent.pid, int(child)]
        tree, alone = rss_tree_mb(parent.pid), rss_tree_mb(int(child))
        assert tree is not None and alone is not None
        assert alone >= 64  # the child's touched pages
        assert tree > alone + 5  # and the parent's interpreter besides
        os.kill(int(child), signal.SIGKILL)
        assert parent.wait(timeout=10) == 0  # it reaped its child and ended
    finally:
        parent.kill()
        parent.wait()
    assert rss_tree_mb(parent.pid) is None
    assert rss_tree_mb(int(child)) is None
