"""Sealed records: integrity, order and freshness for every byte after a handshake.

A :class:`SealedTransport` wraps any transport that has ``send_parts(parts)`` and
``recv_into(view)``. Each ``send_parts`` call becomes one record, or several of
at most ``max_send`` bytes (1 MiB by default) when it is larger::

    u64 length | payload (length bytes) | 16-byte tag

A large send's leading small parts (a frame's head: the bytes its receiver sizes
memory from) go in a record of their own, so a receiver reads them verified; and
since no record is larger than ``max_send``, a receiver holds at most that many
bytes that have not been verified yet, whatever an attacker on the path declares.

The tag covers the record's sequence number (implicit: records are counted in
each direction), its length and its payload, under the sending direction's key
(:meth:`disco_core.net.security.Handshake.keys`). So a record cannot be
altered, injected, dropped, reordered or replayed without the next check
failing, and a record from another connection never verifies on this one.

Payloads are not encrypted (run TLS for secrecy). A small record (under
``LARGE_RECORD``) is read whole, payload and tag in one receive, and checked
before any of it is handed over (:attr:`SealedTransport.pending` says how much
of it the caller has not taken yet). A large one is received straight into the
caller's memory and checked there: no copy is taken, and its last bytes are
only handed over once its tag has verified, so a caller that reads a whole frame
before acting on it never acts on a forged one (:attr:`SealedTransport.record_left`
tells a caller whether what it holds is all verified); a caller that streams a
record's bytes onward (a file) must be ready to drop them when
:class:`~disco_core.errors.IntegrityError` is raised. The length of a record,
where a reader waits for its peer, is read through the transport's polling
``recv_head_into`` when it has one.

Two MACs, chosen by the record's length (which is itself authenticated):
keyed BLAKE2b for small records (about 1 µs each), Poly1305 from
``cryptography`` with a one-time key per record for large ones (several GB/s).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any

from .. import _interrupts
from ..errors import DiscoError, FrameLimitError, IntegrityError
from .security import SessionKeys

__all__ = ["SealedTransport", "TAG_BYTES", "LARGE_RECORD", "SEND_RECORD_BYTES"]

#: Size of a record's tag.
TAG_BYTES = 16
#: Records at least this long are tagged with Poly1305, shorter ones with BLAKE2b.
LARGE_RECORD = 64 << 10

#: A large record leaves in pieces of this size (hashed, then sent, one after the other).
_PIECE = 1 << 20
#: The largest record a :class:`SealedTransport` sends unless told otherwise.
SEND_RECORD_BYTES = 1 << 20

_LEN = struct.Struct("<Q")
_SEQ_LEN = struct.Struct("<QQ")


def _poly1305():
    try:
        from cryptography.hazmat.primitives.poly1305 import Poly1305
    except ImportError:  # pragma: no cover - cryptography is a dependency of the network plugins
        raise DiscoError(
            "protected links need the 'cryptography' package: pip install cryptography"
        ) from None
    return Poly1305


def preload() -> None:
    """Import what a protected handshake needs now, not at the first handshake.

    A listener that runs out of file descriptors (a flood of idle connections)
    could not open the modules' files then, and would fail a genuine peer.
    """
    from .security import _hkdf

    try:
        _poly1305()
        _hkdf(b"\0" * 32, salt=b"", info=b"preload", length=32)
    except DiscoError:  # no cryptography: the first protected handshake says so
        pass


class _Direction:
    """The MAC state of one direction: its keys and its record counter."""

    __slots__ = ("small", "otk", "seq", "Poly1305")

    def __init__(self, key: bytes) -> None:
        if len(key) != 64:
            raise ValueError("a direction's key is 64 bytes")
        # keyed once; each record copies the keyed state (cheaper than keying again)
        self.small = hashlib.blake2b(key=key[:32], digest_size=TAG_BYTES)
        self.otk = hashlib.blake2b(key=key[32:], digest_size=32)
        self.seq = 0
        self.Poly1305 = _poly1305()

    def start(self, length: int) -> Any:
        """A MAC object for the next record of ``length`` bytes (the counter moves on)."""
        head = _SEQ_LEN.pack(self.seq, length)
        if length < LARGE_RECORD:
            mac = self.small.copy()
            mac.update(head)
        else:
            otk = self.otk.copy()
            otk.update(head)
            mac = self.Poly1305(otk.digest())
            mac.update(head)
        self.seq += 1
        return mac


def _tag(mac: Any) -> bytes:
    return mac.digest() if hasattr(mac, "digest") else mac.finalize()


class SealedTransport:
    """A transport whose every ``send_parts`` call is one sealed record.

    Parameters
    ----------
    inner : transport
        Has ``send_parts(list of buffers)``, ``recv_into(writable view) -> int``
        (0 at end of stream), and optionally ``fileno``, ``settimeout``,
        ``close`` and ``recv_head_into`` (passed through).
    keys : SessionKeys
        From the handshake (:meth:`Handshake.keys`).
    max_record : int
        The largest record accepted from the peer; a larger declared length
        raises :class:`~disco_core.errors.FrameLimitError` before anything is read.
    max_send : int
        The largest record this side sends (a larger ``send_parts`` leaves as
        several); at least ``LARGE_RECORD``.

    Notes
    -----
    Sends must be serialised by the caller (one record at a time), and so must
    receives; a send and a receive may run at the same time.
    """

    def __init__(
        self,
        inner: Any,
        keys: SessionKeys,
        max_record: int = 1 << 40,
        max_send: int = SEND_RECORD_BYTES,
    ) -> None:
        if max_send < LARGE_RECORD:
            raise ValueError(f"max_send must be at least {LARGE_RECORD} bytes, got {max_send}")
        self.inner = inner
        self.max_record = int(max_record)
        self.max_send = int(max_send)
        self._out = _Direction(keys.send)
        self._in = _Direction(keys.recv)
        self._left = 0  # payload bytes still to come in the current (large) record
        self._mac: Any = None
        self._small = bytearray(TAG_BYTES)
        self._held: memoryview | None = None  # verified bytes of a small record, not taken yet
        self._broken: str | None = None
        self._sent_broken: str | None = None  # the sending side cut by a second interrupt

    @property
    def record_left(self) -> int:
        """Bytes of the large record being received that are still to come (0 between records).

        While it is not 0, some bytes already handed over have not been verified.
        """
        return self._left

    @property
    def pending(self) -> int:
        """Verified bytes of a small record that the caller has not taken yet."""
        return self._held.nbytes if self._held is not None else 0

    # -- pass-through ---------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # fileno, settimeout, close, sock, ...: whatever the inner transport offers
        return getattr(self.inner, name)

    def sendfile(self, file: Any, size: int) -> int:
        """Nothing is sent around the seal: callers fall back to ``send_parts``."""
        return 0

    # -- sending --------------------------------------------------------------------
    @_interrupts.protect(blocking=True)
    def send_parts(self, parts: list) -> None:
        """Send ``parts`` (buffers) as one record, or several when it is over ``max_send``.

        When the parts come to a large record (``LARGE_RECORD`` or more), the
        small parts before the first large one are a record of their own: a frame's
        head, whose lengths the peer sizes memory from, reaches it verified.

        Ctrl-C is held back until the records are out (``disco_core._interrupts``): a
        record's number is taken before it is written, so a record cut short, or
        never sent after its number was taken, broke the peer's next check and ended
        the session. A second Ctrl-C during a blocked write cuts the stream: later
        sends say so.
        """
        try:
            if self._sent_broken is not None:
                raise IntegrityError(self._sent_broken)
            self._send_records(parts)
        except KeyboardInterrupt:
            if _interrupts.state.escalated:
                self._sent_broken = "a second interrupt cut a sealed record being sent: the stream is broken"  # fmt: skip
            raise
        finally:
            _interrupts.deliver()

    def _send_records(self, parts: list) -> None:
        views = []
        total = 0
        for p in parts:
            v = p if type(p) is memoryview else memoryview(p)
            if v.format != "B" or v.ndim != 1:
                v = v.cast("B")
            if v.nbytes:
                views.append(v)
                total += v.nbytes
        if total < LARGE_RECORD:
            if total:
                self._send_record(views, total)
            return
        # the head: the small parts before the first large one, in a record of its own
        head = 0
        size = 0
        while head < len(views) and views[head].nbytes < LARGE_RECORD:
            size += views[head].nbytes
            head += 1
        if head and size < LARGE_RECORD:
            self._send_record(views[:head], size)
            views = views[head:]
            total -= size
        # the rest in records of at most max_send bytes
        limit = self.max_send
        group: list = []
        size = 0
        for v in views:
            while v.nbytes:
                take = v[: limit - size]
                group.append(take)
                size += take.nbytes
                v = v[take.nbytes :]
                if size == limit:
                    self._send_record(group, size)
                    group, size = [], 0
        if group:
            self._send_record(group, size)

    def _send_record(self, views: list, total: int) -> None:
        """One record of the non-empty byte views ``views`` (``total`` bytes in all)."""
        mac = self._out.start(total)
        if total < LARGE_RECORD:
            for v in views:
                mac.update(v)
            self.inner.send_parts([_LEN.pack(total), *views, _tag(mac)])
            return
        # a large record leaves piece by piece, each tagged into the MAC just before it
        # goes: the peer checks one piece while this side hashes the next
        out: list = [_LEN.pack(total)]
        size = 0
        for v in views:
            while v.nbytes:
                take = v[: _PIECE - size]
                mac.update(take)
                out.append(take)
                size += take.nbytes
                v = v[take.nbytes :]
                if size == _PIECE:
                    self.inner.send_parts(out)
                    out, size = [], 0
        out.append(_tag(mac))
        self.inner.send_parts(out)

    # -- receiving ------------------------------------------------------------------
    def recv_into(self, view: Any) -> int:
        """Receive at most the rest of the current record into ``view``; 0 at end of stream."""
        return self._recv(view, self.inner.recv_into)

    def recv_head_into(self, view: Any) -> int:
        return self._recv(view, getattr(self.inner, "recv_head_into", self.inner.recv_into))

    def _recv(self, view: Any, recv: Any) -> int:
        if self._broken is not None:
            raise IntegrityError(self._broken)
        if self._held is None and not self._left:
            if not self._begin():
                return 0
        if self._held is not None:
            return self._serve(view)
        v = view if type(view) is memoryview else memoryview(view)
        if v.nbytes > self._left:
            v = v[: self._left]
        n = recv(v)
        if not n:
            raise EOFError("the peer closed the connection in the middle of a record")
        self._mac.update(v[:n])
        self._left -= n
        if not self._left:
            self._finish()
        return n

    def begin_record(self) -> int:
        """Between records, with nothing verified waiting: read the next record's head.

        For a caller that moves large records' payloads around this transport (see
        :meth:`absorb`). Returns :attr:`record_left`: the new record's payload when it
        is large, else 0 (a small record, now read whole and :attr:`pending`; the
        end of the stream, which the next receive reports; or bytes still held).
        """
        if self._broken is not None:
            raise IntegrityError(self._broken)
        if self._held is None and not self._left:
            self._begin()
        return self._left

    def absorb(self, data: Any) -> None:
        """Count payload bytes the caller moved around this transport into the current record.

        For a caller that splices a large record's payload from the socket straight
        into a file: ``data`` holds those bytes as received, in order (e.g. a map of
        the file's pages); they go into the record's MAC as if :meth:`recv_into` had
        delivered them, and the tag is checked when the record ends
        (:class:`~disco_core.errors.IntegrityError`).

        Raises
        ------
        ValueError
            No large record is under way, or ``data`` is longer than what is left of it.
        """
        v = data if type(data) is memoryview else memoryview(data)
        if v.format != "B" or v.ndim != 1:
            v = v.cast("B")
        if self._held is not None or v.nbytes > self._left:
            raise ValueError(
                f"absorb() of {v.nbytes} bytes where the current large record has {self._left} left"
            )
        self._mac.update(v)
        self._left -= v.nbytes
        if not self._left:
            self._finish()

    def _serve(self, view: Any) -> int:
        held: memoryview = self._held  # type: ignore[assignment]  # _recv serves only a held record
        v = view if type(view) is memoryview else memoryview(view)
        if v.format != "B" or v.ndim != 1:
            v = v.cast("B")
        n = min(v.nbytes, held.nbytes)
        v[:n] = held[:n]
        self._held = held[n:] if n < held.nbytes else None
        return n

    def _read_exact(self, n: int, at_boundary: bool = False) -> bytes | None:
        buf = self._small if n == TAG_BYTES else bytearray(n)
        view = memoryview(buf)
        got = 0
        if at_boundary:  # where the reader waits for the peer: poll a little before sleeping
            got = getattr(self.inner, "recv_head_into", self.inner.recv_into)(view)
            if not got:
                return None
        while got < n:
            k = self.inner.recv_into(view[got:])
            if not k:
                if at_boundary and not got:
                    return None
                raise EOFError("the peer closed the connection in the middle of a record")
            got += k
        return bytes(buf)

    def _begin(self) -> bool:
        head = self._read_exact(_LEN.size, at_boundary=True)
        if head is None:
            return False
        (length,) = _LEN.unpack(head)
        if not 0 < length <= self.max_record:
            raise FrameLimitError(
                f"the peer declared a record of {length} bytes (this side accepts 1 to "
                f"{self.max_record})"
            )
        mac = self._in.start(length)
        if length >= LARGE_RECORD:
            self._left = length
            self._mac = mac
            return True
        body = bytearray(length + TAG_BYTES)  # payload and tag: one receive, checked whole
        view = memoryview(body)
        got = 0
        while got < len(body):
            k = self.inner.recv_into(view[got:])
            if not k:
                raise EOFError("the peer closed the connection in the middle of a record")
            got += k
        mac.update(view[:length])
        self._check(bytes(view[length:]), mac)
        self._held = view[:length]
        return True

    def _check(self, tag: bytes, mac: Any) -> None:
        if not hmac.compare_digest(tag, _tag(mac)):
            self._broken = (
                "a record from the peer failed its integrity check (altered, injected, "
                "reordered or replayed); the connection cannot be trusted any more"
            )
            raise IntegrityError(self._broken)

    def _finish(self) -> None:
        tag: bytes = self._read_exact(TAG_BYTES)  # type: ignore[assignment]  # None: at a boundary only
        mac, self._mac = self._mac, None
        self._check(tag, mac)
