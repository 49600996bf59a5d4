"""The command protocol: actions, zero-copy (de)serialisation, framing over real pipes."""

from __future__ import annotations

import os
import pickle
import struct
import threading

import numpy as np
import pytest

import disco_core as disco
from disco_core import protocol
from disco_core.errors import FrameLimitError
from disco_core.protocol import OOB_THRESHOLD, Action, FrameReader, RegRef, decode, encode


def test_actions_keep_tvm_codes():
    expected = [
        "SHUTDOWN",
        "KILL_REG",
        "GET_GLOBAL_FUNC",
        "CALL_PACKED",
        "SYNC_WORKER",
        "COPY_FROM_WORKER0",
        "COPY_TO_WORKER0",
        "DEBUG_GET_FROM_REMOTE",
        "DEBUG_SET_REGISTER",
    ]
    assert [a.name for a in Action] == expected
    assert [int(a) for a in Action] == list(range(9))


@pytest.mark.parametrize(
    "value",
    [
        1,
        -(2**80),
        2.5,
        True,
        None,
        "text",
        b"\x00\xff",
        (1, [2, (3, "x")], {"k": (None,)}),
        np.dtype("float16"),
        disco.Device("cuda", 3),
        np.float32(1.25),
    ],
    ids=repr,
)
def test_roundtrip_values(value):
    header, buffers = encode(value)
    assert buffers == []
    back = decode(header, buffers)
    assert back == value and type(back) is type(value)


def test_large_array_travels_out_of_band_without_copy():
    arr = np.arange(1 << 18, dtype="float64")  # 2 MiB
    header, buffers = encode(("cmd", arr))
    assert len(header) < 1024, "the array's data went into the pickle header"
    assert len(buffers) == 1 and buffers[0].nbytes == arr.nbytes
    assert np.shares_memory(np.asarray(buffers[0]), arr), "the buffer is a copy"
    received = [bytearray(b) for b in buffers]  # what a reader hands to decode
    _, back = decode(header, received)
    np.testing.assert_array_equal(back, arr)
    assert back.flags.writeable
    assert np.shares_memory(back, np.frombuffer(received[0], dtype=np.uint8))


def test_small_array_in_band():
    arr = np.arange(OOB_THRESHOLD // 8 - 1, dtype="float64")
    header, buffers = encode(arr)
    assert buffers == [] and len(header) > arr.nbytes
    np.testing.assert_array_equal(decode(header), arr)


@pytest.mark.parametrize(
    "arr",
    [
        np.asfortranarray(np.arange(10000, dtype="int32").reshape(100, 100)),
        np.arange(30000, dtype="float32")[::3],
        np.zeros((0, 3)),
        np.array(7, dtype="int16"),
    ],
    ids=["fortran", "strided", "empty", "0d"],
)
def test_array_layouts_roundtrip(arr):
    header, buffers = encode(arr)
    back = decode(header, [bytearray(b) for b in buffers])
    assert back.shape == arr.shape and back.dtype == arr.dtype
    np.testing.assert_array_equal(back, arr)


def test_dref_becomes_regref():
    ref = disco.DRef(None, 42)
    try:
        header, buffers = encode((1, [ref, (ref,)]))
        back = decode(header, buffers)
    finally:
        ref.reg_id = 0
    assert isinstance(back[1][0], RegRef) and back[1][0].reg_id == 42
    assert back[1][1][0].reg_id == 42
    assert b"DRef" not in header and b"disco_core.session" not in header


def test_dref_cannot_be_pickled_outside_a_command():
    ref = disco.DRef(None, 3)
    try:
        with pytest.raises(TypeError):
            pickle.dumps(ref)
    finally:
        ref.reg_id = 0


def test_unpicklable_value_raises():
    with pytest.raises((TypeError, pickle.PicklingError, AttributeError)):
        encode(threading.Lock())


def test_isolate_copies_arrays_and_shares_immutables():
    arr = np.arange(5)
    s = "text"
    value = (arr, [arr, s], {"a": arr})
    out = protocol.isolate(value)
    assert out[1][1] is s
    for copy in (out[0], out[1][0], out[2]["a"]):
        np.testing.assert_array_equal(copy, arr)
        assert not np.shares_memory(copy, arr)
    with pytest.raises((TypeError, pickle.PicklingError, AttributeError)):
        protocol.isolate([threading.Lock()])


def _pipe_roundtrip(frames, flags=0):
    r, w = os.pipe()
    errors = []

    def writer():
        try:
            for frame in frames:
                protocol.write_frame(w, frame, flags)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            os.close(w)

    t = threading.Thread(target=writer)
    t.start()
    reader = FrameReader(r)
    got = []
    try:
        for _ in frames:
            got.append(reader.read())
        with pytest.raises(EOFError):
            reader.read()
    finally:
        t.join(10)
        reader.close()
        os.close(r)
    assert not errors
    return got


@pytest.mark.timeout(30)
def test_frames_over_a_real_pipe():
    big = np.random.default_rng(0).standard_normal(1 << 20)  # 8 MiB: more than a pipe holds
    values = [("small", 1), ("big", big, np.arange(5000, dtype="int8")), ("empty", b"")]
    frames = [encode(v) for v in values]
    got = _pipe_roundtrip(frames, flags=5)
    for value, (header, buffers, flags) in zip(values, got):
        assert flags == 5
        back = decode(header, buffers)
        assert back[0] == value[0]
    _, b, i8 = decode(got[1][0], got[1][1])
    np.testing.assert_array_equal(b, big)
    np.testing.assert_array_equal(i8, np.arange(5000, dtype="int8"))


@pytest.mark.timeout(30)
def test_many_small_frames_over_a_pipe():
    frames = [encode((Action.CALL_PACKED, i, 1, (i, "x" * (i % 50)))) for i in range(2000)]
    got = _pipe_roundtrip(frames)
    assert [decode(h, b)[1] for h, b, _ in got] == list(range(2000))


@pytest.mark.timeout(30)
def test_eof_in_the_middle_of_a_frame():
    header, buffers = encode(np.arange(100000, dtype="float64"))
    head = struct.pack("<QII", len(header), 1, 0) + struct.pack("<Q", buffers[0].nbytes) + header
    r, w = os.pipe()
    try:
        os.write(w, head + bytes(100))  # the buffer is cut short
        os.close(w)
        w = -1
        with pytest.raises(EOFError):
            FrameReader(r).read()
    finally:
        os.close(r)
        if w != -1:
            os.close(w)


@pytest.mark.timeout(30)
def test_corrupt_size_is_refused():
    r, w = os.pipe()
    try:
        os.write(w, struct.pack("<QII", 1 << 60, 0, 0))
        with pytest.raises(FrameLimitError, match="header of 1152921504606846976 bytes"):
            FrameReader(r).read()
    finally:
        os.close(r)
        os.close(w)


_SCRIPT = """
import enum, sys
import disco_core as disco

class Color(enum.IntEnum):
    RED = 1

class Point:
    pass

def helper():
    return 1

with disco.ProcessSession(2) as sess:
    sess.import_python_module("disco_core.testing.funcs")
    echo = sess.get_global_func("testing.echo")
    for value in (Color.RED, Point(), [1, {"f": helper}]):
        try:
            echo(value)
        except disco.DiscoTypeError as exc:
            print("refused:", str(exc).split(" (")[0])
        else:
            print("sent:", value)
    print("still usable:", echo(7).debug_get_from_remote(1))
"""


@pytest.mark.timeout(120)
def test_a_value_of_the_scripts_main_is_refused_at_the_call_not_a_dead_worker(tmp_path):
    """A worker process does not run the controller's script, so a class or function
    defined there cannot be rebuilt in it: refused at the call (the worker read the
    command, failed to unpickle it and ended, and the session with it)."""
    import subprocess
    import sys

    script = tmp_path / "user_script.py"
    script.write_text(_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=100, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == [
        "refused: cannot send Color",
        "refused: cannot send Point",
        "refused: cannot send helper",
        "still usable: 7",
    ], out.stdout + out.stderr


@pytest.mark.timeout(60)
def test_a_command_for_worker_0_alone_is_never_pickled(monkeypatch):
    """The check for the script's values (above) pickled every command with an array as
    it was sent, also those for worker 0 alone, which runs in the controller's process:
    a pickle of each ``copy_to_worker_0`` (about 10 us, the array out of band) took process
    copies of 1 MiB from 36 to 24 GB/s (bench_core, found in a run_all on 2026-11-29)."""
    from disco_core.channels import base

    pickled = []
    real = base._encode_for_workers
    monkeypatch.setattr(
        base, "_encode_for_workers", lambda cmds: pickled.append(cmds) or real(cmds)
    )
    with disco.ProcessSession(2) as sess:
        host = np.arange(1 << 18, dtype=np.float32)
        d = sess.empty(host.shape, "float32", worker0_only=True)
        pickled.clear()
        sess.copy_to_worker_0(host, d)
        out = np.empty_like(host)
        sess.copy_from_worker_0(out, d)
        sess.sync_worker_0()
        assert np.array_equal(out, host)
        assert pickled == []
        sess.import_python_module("disco_core.testing.funcs")
        echo = sess.get_global_func("testing.echo")
        pickled.clear()
        assert np.array_equal(echo(host).debug_get_from_remote(1), host)
        assert pickled  # a command for the worker processes still is
