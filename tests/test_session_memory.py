"""A controller that opens many sessions one after another does not keep growing.

Each session's threads (worker 0, helpers) get glibc malloc arenas of their own, and
NumPy arrays of a few MiB are then served from them; without a trim the freed memory
stays there after the session (measured on a 2-core machine over 40 sessions of 4
workers with 8 MiB arrays: 68 -> 77 MiB for ProcessSession, 61 -> 84 MiB for
ThreadedSession, reached within ~10-20 sessions, then flat; on a machine with more
cores glibc allows more arenas: 56 -> 203 MiB was seen). ``_close_channel`` calls
``malloc_trim(0)`` (``disco_core._memory``).

The first check, with glibc's defaults: from the 10th session to the 30th, at most
48 MiB more (a coarse bound on what the arenas keep; a per-session leak is the second
check's to catch). A quiet machine gives at most one step of the 8 MiB arrays' size.
On a loaded one (both CPUs busy, as in CI's two test streams) the steps come later and
keep coming for a while: 64 -> 96 MiB between sessions 10 and 60 was seen.

Those steps are glibc's, not Disco's: its mmap threshold is dynamic. The first
8 MiB array is mapped on its own and unmapped when freed, which raises the
threshold above 8 MiB; from then on such arrays come from the arenas of whichever
threads allocate them, and each arena keeps some of that memory. With the threshold
fixed (``MALLOC_MMAP_THRESHOLD_``, which turns the adjustment off) the same program
under the same load stays flat (48-49 MiB over 60 sessions, twice, where the default
gave 56 -> 88 and 56 -> 96). So a second run, with the threshold fixed, checks
Disco's own memory closely: at most 4 MiB more from the 10th session to the 60th.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from disco_core import _memory

CHILD = r"""
import json, sys
import numpy as np
import disco_core as disco

def rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

a = np.random.default_rng(0).standard_normal(1 << 20)  # 8 MiB
out = []
for r in range(int(sys.argv[1])):
    with disco.ProcessSession(2) as sess:
        sess.init_ccl("shm")
        for k in range(2):
            x = sess.broadcast(a + k)
            y = sess.empty(a.shape, "float64")
            sess.allreduce(x, y, op="sum", in_group=False)
            assert y.debug_get_from_remote(1)[0] == (a[0] + k) * 2
            del x, y
    out.append(rss_mib())
print("RSS " + json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.timeout(300)
def test_rss_stays_flat_over_many_sessions():
    r = subprocess.run(
        [sys.executable, "-c", CHILD, "30"], capture_output=True, text=True, timeout=280,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rss = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RSS "))[4:])
    assert len(rss) == 30 and rss[-1] - rss[9] < 48, rss


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.timeout(300)
def test_rss_is_flat_when_glibc_does_not_move_its_mmap_threshold():
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    r = subprocess.run(
        [sys.executable, "-c", CHILD, "60"], capture_output=True, text=True, timeout=280,
        stdin=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rss = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RSS "))[4:])
    assert len(rss) == 60 and rss[-1] - rss[9] < 4, rss


def test_release_free_memory_is_safe():
    assert _memory.release_free_memory() in (True, False)
    if _memory._TRIM is not None:  # glibc: trimming twice in a row is fine
        _memory.release_free_memory()
