"""``disco demo``: the tensor-parallel MLP block, its shard arithmetic and its exit codes."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import disco_core as disco
from disco_core import _procfs, demo, demo_funcs

SMALL = ["--d-model", "64", "--d-ff", "256", "--batch", "4", "--steps", "2", "--warmup", "1"]


def run_demo(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("DISCO_PLUGINS", None)
    env.pop("DISCO_DISABLE_PLUGIN_AUTOLOAD", None)
    return subprocess.run(
        [sys.executable, "-m", "disco_core", "demo", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def reported_errors(out: str) -> list[float]:
    return [float(m) for m in re.findall(r"max abs error ([0-9.eE+-]+)", out)]


# ---------------------------------------------------------------------------- the command
@pytest.mark.timeout(120)
@pytest.mark.parametrize("session", ["process", "threaded"])
def test_demo_small_passes(session):
    proc = run_demo(*SMALL, "--workers", "1,2,4", "--session", session)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "check passed" in out
    # progress lines for each configuration, then the table
    for n in ("1 worker]", "2 workers]", "4 workers]"):
        assert f"[{n} starting" in out
    for row in ("numpy (1 process, no Disco)", f"disco {session}, 2 workers", "4 workers"):
        assert row in out
    errors = reported_errors(out)
    assert len(errors) == 4  # one per session + the final verdict
    assert all(e <= 1e-4 for e in errors), errors


@pytest.mark.timeout(120)
def test_demo_float64_is_tight():
    proc = run_demo(*SMALL, "--workers", "2", "--dtype", "float64")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert max(reported_errors(proc.stdout)) <= 1e-10


@pytest.mark.timeout(120)
def test_demo_fails_loudly_above_tolerance():
    # A float32 sum split over two workers never matches NumPy's to the last bit.
    proc = run_demo(*SMALL, "--workers", "2", "--tol", "0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "CHECK FAILED" in proc.stdout
    assert "ABOVE TOLERANCE" in proc.stdout


@pytest.mark.timeout(60)
def test_demo_rejects_a_split_that_does_not_divide():
    proc = run_demo("--d-ff", "100", "--workers", "3")
    assert proc.returncode == 2
    assert "not divisible" in proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "option, said",
    [
        # it ran the whole demo, then failed every check (outside check)
        (("--tol", "-1"), "--tol must be a finite number >= 0, got -1.0"),
        # every result passed: no check at all (new-user check)
        (("--tol", "inf"), "--tol must be a finite number >= 0, got inf"),
        (("--blas-threads", "-1"), "--blas-threads must be >= 0"),
        # an empty name ran the demo untraced, silently (new-user check)
        (("--trace", ""), "--trace: give a file name"),
    ],
)
def test_demo_rejects_a_bad_option_before_it_runs(option, said):
    proc = run_demo(*option)
    assert proc.returncode == 2
    assert said in proc.stderr
    assert "starting" not in proc.stdout + proc.stderr


@pytest.mark.timeout(60)
def test_demo_rejects_bad_worker_list():
    proc = run_demo("--workers", "two")
    assert proc.returncode == 2
    assert "--workers" in proc.stderr


@pytest.mark.timeout(60)
def test_demo_rejects_a_negative_seed_before_it_runs():
    """It printed the banner, then NumPy's traceback (outside check)."""
    proc = run_demo("--seed", "-1")
    assert proc.returncode == 2
    assert "--seed must be >= 0, got -1" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(60)
def test_demo_checks_every_rows_trace_file_before_it_runs(tmp_path):
    """With several worker counts each row traces into FILE.<n>w.json: a folder of that
    name failed the 2-worker row after the 1-worker row had run (outside check)."""
    (tmp_path / "clash.2w.json").mkdir()
    proc = run_demo("--workers", "1,2", "--trace", str(tmp_path / "clash.json"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "clash.2w.json" in proc.stderr and "is a folder" in proc.stderr
    assert "starting" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("value", ["1,,2", "2,", ",2"])
def test_demo_worker_list_with_a_count_left_out_is_refused(value):
    """'1,,2' ran as '1,2' (outside check): a typo that drops a count is not guessed at."""
    with pytest.raises(argparse.ArgumentTypeError, match="empty count between commas"):
        demo._worker_counts([value])
    assert demo._worker_counts(["1, 2", "4"]) == [1, 2, 4]


# ---------------------------------------------------------------------------- in process
@pytest.mark.timeout(120)
def test_run_in_process_threaded(capsys):
    parser = demo.argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args([*SMALL, "--workers", "2", "--session", "threaded"])
    assert demo.run(args) == 0
    assert "check passed" in capsys.readouterr().out


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_shards_are_megatron_splits(n):
    rng = np.random.default_rng(n)
    d_model, d_ff, batch = 8, 32, 3
    x = rng.standard_normal((batch, d_model))
    w1 = rng.standard_normal((d_model, d_ff))
    w2 = rng.standard_normal((d_ff, d_model))
    w1s, w2s = demo.shard_weights(w1, w2, n)
    f = d_ff // n
    assert w1s.shape == (n, d_model, f) and w2s.shape == (n, f, d_model)
    assert w1s.flags.c_contiguous and w2s.flags.c_contiguous
    for w in range(n):
        np.testing.assert_array_equal(w1s[w], w1[:, w * f : (w + 1) * f])
        np.testing.assert_array_equal(w2s[w], w2[w * f : (w + 1) * f, :])
    partials = []
    for w in range(n):
        out = np.empty((batch, d_model))
        demo_funcs.mlp_shard(x, w1s[w], w2s[w], out)
        partials.append(out)
    np.testing.assert_allclose(sum(partials), demo_funcs.mlp_reference(x, w1, w2), rtol=1e-12)


def test_gelu_is_the_tanh_approximation():
    h = np.linspace(-6, 6, 101)
    expected = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
    np.testing.assert_allclose(demo_funcs.gelu(h.copy()), expected, rtol=1e-12, atol=1e-15)


def test_mlp_shard_checks_shapes():
    x = np.zeros((2, 4))
    with pytest.raises(ValueError, match="do not chain"):
        demo_funcs.mlp_shard(x, np.zeros((5, 3)), np.zeros((3, 4)), np.zeros((2, 4)))
    with pytest.raises(ValueError, match="out has shape"):
        demo_funcs.mlp_shard(x, np.zeros((4, 3)), np.zeros((3, 4)), np.zeros((2, 5)))


def test_blas_threads_round_trip():
    old = demo_funcs.blas_threads()
    if old is None:
        pytest.skip("no controllable BLAS in this process")
    try:
        assert demo_funcs.blas_threads(1) == old
        assert demo_funcs.blas_threads() == 1
    finally:
        demo_funcs.blas_threads(old)
    assert demo_funcs.blas_threads() == old


def test_blas_threads_are_set_through_threadpoolctl_in_a_worker_process():
    """The worker's BLAS really runs with the count the demo asks for."""
    with disco.ProcessSession(2) as sess:
        sess.import_python_module("disco_core.demo_funcs")
        sess.call_packed(demo_funcs.BLAS_THREADS, 1)
        now = sess.call_packed(demo_funcs.BLAS_THREADS, None)
        assert now.debug_get_from_remote(1) == 1


def test_the_table_has_the_overhead_and_the_numpy_steps_taken_in_turn(capsys):
    assert demo.main(["--workers", "1", "--steps", "3", "--warmup", "1", "--d-model", "64",
                      "--d-ff", "256", "--batch", "8"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("configuration"))
    assert "numpy ms" in header and "overhead ms" in header
    row = next(line for line in out.splitlines() if line.startswith("disco process, 1 worker"))
    cells = row.split()
    overhead = float(cells[cells.index("worker") + 6])
    step = float(cells[cells.index("worker") + 4])
    assert 0 <= overhead <= step


def test_numpy_and_disco_steps_are_paired_in_blocks(monkeypatch):
    """Every timed Disco step has a NumPy step of its block; blocks wait for quiet CPUs."""
    waits = []
    monkeypatch.setattr(demo._procfs, "wait_until_idle", lambda: waits.append(1) or 0.0)
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--steps", "7", "--warmup", "1", "--d-model", "32",
                              "--d-ff", "64", "--batch", "4"])  # fmt: skip
    x, w1, w2 = demo._make_problem(args)
    ref = demo_funcs.mlp_reference(x, w1, w2)
    res = demo._run_session(x, w1, w2, args, ref, 2)
    assert len(res.step_times) == len(res.numpy_times) == len(res.overheads) == 7
    assert len(waits) == 2 * 2  # blocks of 5 + 2, a wait before each side of each block


def test_wait_until_idle_outlasts_a_spinning_thread():
    """A thread left spinning (as OpenBLAS's are after a step) is waited out, within the limit."""
    stop = time.monotonic() + 0.3

    def spin():
        while time.monotonic() < stop:
            pass

    t = threading.Thread(target=spin)
    t.start()
    try:
        waited = _procfs.wait_until_idle(limit=2.0)
    finally:
        t.join()
    assert 0.2 <= waited < 2.0
    assert _procfs.wait_until_idle(limit=2.0) < 0.5  # nothing running: back at once
