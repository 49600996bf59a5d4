"""The rendezvous store across disco-socket nodes, over sealed links (a token)."""

from __future__ import annotations

import logging
import secrets

import pytest

import disco_core as disco


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "token, direct", [(None, True), ("store-test-token", True), ("store-test-token", False)]
)
def test_store_across_nodes(cluster, caplog, token, direct):
    """Requests on each worker's own reply connection (direct) or relayed by its agent."""
    secret = b"tok-" + secrets.token_hex(8).encode()
    with caplog.at_level(logging.DEBUG):
        # workers 0 (a thread) and 1 (a process) here, 2 and 3 on an agent
        sess = cluster.session(2, 2, token=token, direct_replies=direct)
        sess.import_python_module("disco_core.testing.funcs")
        get = sess.get_global_func
        ref = get("testing.store_exchange")("sock", 20.0, secret)
        want = [b"value of %d" % w + secret for w in range(4)]
        assert [ref.debug_get_from_remote(w) for w in range(4)] == [want] * 4
        counts = get("testing.store_add")("n")
        assert sorted(counts.debug_get_from_remote(w) for w in range(4)) == [1, 2, 3, 4]
        get("testing.store_get")("sock/never", 0.3)
        with pytest.raises(disco.DiscoTimeoutError, match="sock/never"):
            sess._sync_all()
        sess.shutdown()
    assert secret.decode() not in caplog.text


@pytest.mark.timeout(90)
@pytest.mark.parametrize("token, direct", [(None, True), ("store-test-token", False)])
def test_a_malformed_reply_from_a_node_is_dropped(cluster, monkeypatch, token, direct):
    """A reply that decodes but is no message (from a worker on another node) is dropped:
    the reader goes on and the session answers within the liveness bound."""
    import time

    monkeypatch.setenv("DISCO_LIVENESS_TIMEOUT", "3")
    sess = cluster.session(2, 2, token=token, direct_replies=direct)
    sess.import_python_module("disco_core.testing.funcs")
    send = sess.get_global_func("testing.send_raw_reply")
    t0 = time.monotonic()
    for bad in ((), 42):
        assert send(bad, 3).debug_get_from_remote(3) is None
    sess._sync_all()
    assert time.monotonic() - t0 < 10
    sess.shutdown()
