"""A ``copyfrom``'s array goes from the socket straight into the remote tensor.

The server used to receive it into an array of its own and copy that into the
tensor: an extra copy of every byte (and as much fresh memory) on the way through
the socket. These tests run the server's request loop in a thread over a socket
pair, so what the server does with the bytes can be watched.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from disco_core.spi import SocketTransport
from disco_rpc import wire
from disco_rpc.errors import ProtocolError
from disco_rpc.handler import SessionHandler, receive_in_place, serve_conn
from disco_rpc.protocol import ERROR, OP_TENSOR_SET, REPLY, REQUEST

pytestmark = pytest.mark.timeout(60)


class _Ref:
    """A client's remote object, as it travels: its handle."""

    def __init__(self, hid: int) -> None:
        self._rpc_ref = wire.HandleRef(wire.HandleRef.TENSOR, hid)


@pytest.fixture
def served(tmp_path):
    """(client Conn, the session's handler): the request loop runs in a thread."""
    a, b = socket.socketpair()
    client, server = wire.Conn(SocketTransport(a)), wire.Conn(SocketTransport(b))
    handler = SessionHandler(str(tmp_path / "work"))
    loop = threading.Thread(target=serve_conn, args=(server, handler), daemon=True)
    loop.start()
    yield client, handler
    a.close()
    loop.join(10)
    b.close()
    handler.close()


def _tensor_set(client: wire.Conn, hid: int, arr: np.ndarray):
    client.send(REQUEST, OP_TENSOR_SET, ((), (_Ref(hid), arr)))
    return client.recv()


def test_copyfrom_lands_in_the_tensor_without_an_array_of_its_own(served, monkeypatch):
    client, handler = served
    tensor = np.zeros((1024, 1024), dtype=np.float32)  # 4 MiB
    hid = handler.export(tensor).hid
    source = np.arange(1, tensor.size + 1, dtype=np.float32).reshape(2048, 512)  # other shape
    made = []  # the arrays the decoder makes for the frame's buffers, zeroed to show writes

    def empty(shape, dtype=float):
        arr = np.zeros(shape, dtype)
        made.append(arr)
        return arr

    monkeypatch.setattr(wire.np, "empty", empty)
    kind, _op, _value = _tensor_set(client, hid, source)
    assert kind == REPLY
    assert np.array_equal(tensor.reshape(-1), source.reshape(-1))
    # the decoder's array (made, then left aside, never touched: no pages) got no byte
    assert [a.shape for a in made] == [source.shape] and not made[0].any()


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda: np.zeros(1000, dtype=np.float64), "does not match"),  # another size
        (lambda: np.zeros(1024, dtype=np.float64)[::2], None),  # a view with gaps: copied
        (lambda: np.zeros(512, dtype=np.float32), "does not match"),  # another dtype
    ],
)
def test_a_tensor_that_cannot_take_the_bytes_in_place_still_gets_them_or_refuses(served, make, why):
    client, handler = served
    tensor = make()
    hid = handler.export(tensor).hid
    source = np.arange(512, dtype=np.float64)
    kind, _op, value = _tensor_set(client, hid, source)
    if why is None:
        assert kind == REPLY and np.array_equal(tensor, source)
    else:
        assert kind == ERROR and why in value[1]
        assert not tensor.any()
    # still in step: the next request is answered
    ok = np.zeros(512, dtype=np.float64)
    kind, _op, _value = _tensor_set(client, handler.export(ok).hid, source)
    assert kind == REPLY and np.array_equal(ok, source)


def test_a_read_only_tensor_is_refused_and_left_as_it_was(served):
    client, handler = served
    tensor = np.zeros(512, dtype=np.float64)
    tensor.flags.writeable = False
    kind, _op, value = _tensor_set(client, handler.export(tensor).hid, np.ones(512))
    assert kind == ERROR and not tensor.any()


def test_a_sealed_copyfrom_changed_on_the_way_never_reaches_the_tensor(tmp_path):
    """On a sealed link a frame's bytes are verified when it ends: a relay that changes
    a byte of the payload makes the server drop the session, and the tensor keeps what
    it held (received in place, it got the changed bytes before the check)."""
    from disco_core.net.security import Handshake

    c, s = Handshake(b"t", "client", b"x"), Handshake(b"t", "server", b"x")
    c.bind(b"h", b"r")
    s.bind(b"h", b"r")

    class Recorder:
        def __init__(self) -> None:
            self.data = bytearray()

        def send_parts(self, parts) -> None:
            for p in parts:
                self.data += memoryview(p).cast("B")

    sent = Recorder()
    client = wire.Conn(wire.SealedLink(sent, c.keys()))
    a, b = socket.socketpair()
    server = wire.Conn(SocketTransport(b))
    server.t = wire.SealedLink(server.t, s.keys())
    handler = SessionHandler(str(tmp_path / "work"))
    tensor = np.zeros(1 << 18, dtype=np.float64)  # 2 MiB: records of 1 MiB pieces
    client.send(REQUEST, OP_TENSOR_SET, ((), (_Ref(handler.export(tensor).hid), np.ones(1 << 18))))
    sent.data[len(sent.data) // 2] ^= 1  # a relay's change, inside the payload
    loop = threading.Thread(target=serve_conn, args=(server, handler), daemon=True)
    loop.start()

    def send() -> None:  # the server stops reading at the failed record: the rest may stay
        try:
            a.sendall(sent.data)
        except OSError:
            pass

    threading.Thread(target=send, daemon=True).start()
    try:
        loop.join(10)
        assert not loop.is_alive()  # the session was dropped
        assert not tensor.any()
    finally:
        a.close()
        b.close()
        handler.close()


def test_only_a_copyfrom_is_received_in_place():
    arr, tensor = np.empty(4), np.zeros(4)
    fills = [(0, arr.view(np.uint8).data)]
    value = ((), (tensor, arr))
    assert receive_in_place(OP_TENSOR_SET + 1, value, fills) == (value, fills)
    assert receive_in_place(OP_TENSOR_SET, ((), (tensor,)), fills)[1] is fills
    new_value, new_fills = receive_in_place(OP_TENSOR_SET, value, fills)
    assert new_value == ((), (tensor, tensor)) and new_fills[0][1].obj is not arr
    with pytest.raises(ProtocolError):  # (what a malformed request still raises)
        wire.decode(b"")
