"""Worker-side functions of the rendezvous store's tests (``testing.store_*``).

Imported by :mod:`disco_core.testing.funcs`, so every kit session has them.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ..registry import register_func
from ..worker import current

__all__ = ["LOG"]

#: What ``testing.store_log`` recorded, per worker id (a process holds one or all workers).
LOG: dict[int, list] = {}


def _reg(name: str):
    def deco(func):
        register_func(f"testing.{name}", func, override=True)
        return func

    return deco


@_reg("store_exchange")
def store_exchange(prefix: str, timeout: float, secret: bytes = b"") -> list[bytes]:
    """Every worker sets ``prefix/<id>``, then reads every worker's key: all of them."""
    ctx = current()
    store = ctx.store
    store.set(f"{prefix}/{ctx.worker_id}", b"value of %d" % ctx.worker_id + secret)
    store.wait([f"{prefix}/{w}" for w in range(ctx.num_workers)], timeout)
    return [store.get(f"{prefix}/{w}", timeout) for w in range(ctx.num_workers)]


@_reg("store_add")
def store_add(key: str, amount: int = 1) -> int:
    """``store.add(key, amount)`` on every worker; the value it returned here."""
    return current().store.add(key, amount)


@_reg("store_get")
def store_get(key: str, timeout: float | None = None) -> bytes:
    return current().store.get(key, timeout)


@_reg("store_set")
def store_set(key: str, value: bytes, only_worker: int | None = None) -> None:
    if only_worker is None or current().worker_id == only_worker:
        current().store.set(key, value)


@_reg("store_get_or_note")
def store_get_or_note(key: str, timeout: float, folder: str) -> None:
    """``get``; a failure is also written to ``folder/<worker id>`` (seen even after a death)."""
    ctx = current()
    try:
        ctx.store.get(key, timeout)
    except Exception as exc:
        path = os.path.join(folder, str(ctx.worker_id))
        with open(path + ".tmp", "w") as f:
            f.write(f"{time.monotonic()}\n{type(exc).__name__}: {exc}")
        os.replace(path + ".tmp", path)
        raise


@_reg("store_bad_calls")
def store_bad_calls() -> list[tuple[str, str, str]]:
    """Each wrong use of the store: (call, error type, message); none may reach the controller."""
    store = current().store
    calls: list[tuple[str, Any]] = [
        ("set(int key)", lambda: store.set(7, b"x")),  # type: ignore[arg-type]
        ("set(empty key)", lambda: store.set("", b"x")),
        ("set(long key)", lambda: store.set("k" * 257, b"x")),
        ("set(str value)", lambda: store.set("k", "text")),  # type: ignore[arg-type]
        ("set(big value)", lambda: store.set("k", bytes((1 << 20) + 1))),
        ("get(bytes key)", lambda: store.get(b"k")),  # type: ignore[arg-type]
        ("get(negative timeout)", lambda: store.get("k", -1)),
        ("wait(str keys)", lambda: store.wait("abc")),
        ("add(float amount)", lambda: store.add("k", 1.5)),  # type: ignore[arg-type]
    ]
    out = []
    for name, call in calls:
        try:
            call()
        except Exception as exc:
            out.append((name, type(exc).__name__, str(exc)))
        else:
            out.append((name, "", ""))
    return out


@_reg("store_wait_then_log")
def store_wait_then_log(key: str, delay: float) -> None:
    """Worker 0 sets ``key`` after ``delay`` s; the others wait for it, then log "waited"."""
    ctx = current()
    LOG[ctx.worker_id] = []
    if ctx.worker_id == 0:
        time.sleep(delay)
        ctx.store.set(key, b"go")
    else:
        ctx.store.get(key, 30.0)
    LOG[ctx.worker_id].append("waited")


@_reg("store_log")
def store_log(item: Any) -> int:
    """Append ``item`` to this worker's log; its length."""
    log = LOG.setdefault(current().worker_id, [])
    log.append(item)
    return len(log)


@_reg("store_read_log")
def store_read_log() -> list:
    return list(LOG.get(current().worker_id, []))


@_reg("store_from_thread")
def store_from_thread(key: str) -> str:
    """``store.set`` from a thread the worker function starts: "ok", or the error."""
    import threading

    store, out = current().store, []

    def run() -> None:
        try:
            store.set(key, b"from a thread")
            out.append("ok")
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    return out[0] if out else "still running"


@_reg("store_add_error")
def store_add_error(key: str, amount: int) -> str:
    """``store.add(key, amount)``: the error's type and text, or "ok"."""
    try:
        current().store.add(key, amount)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


@_reg("send_raw_reply")
def send_raw_reply(message: Any, only_worker: int) -> None:
    """On worker ``only_worker``, a worker process: send ``message`` up its reply path as
    it is (a malformed-peer test)."""
    if current().worker_id != only_worker:
        return
    send = getattr(current().store, "_send", None)  # a worker process's RemoteStore
    if send is None:
        raise RuntimeError("testing.send_raw_reply: this worker has no reply path of its own")
    send(message)
