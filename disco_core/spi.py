"""What a plugin author imports to build channels, CCLs and transports.

``disco_core`` is the user's API; this module is the author's. A plugin
imports ``disco_core``, ``disco_core.spi`` and ``disco_core.testing`` and
nothing else of the core (an import-linter contract checks that for the
plugins in this repository), so everything below is public and kept stable.

Channels
    :class:`LinkChannel` (a channel over one link per worker), the link kinds
    (:class:`WorkerLink`, :class:`ThreadWorkerLink`, :class:`BatchingLink`,
    :class:`ProcessWorkerLink`), :class:`ReplyHub` and :class:`ReplyReader`
    (replies from many workers), :class:`Outgoing`, worker processes
    (:func:`worker_env`, :func:`worker_argv`, :func:`exit_reason`,
    :func:`stop_worker`, :func:`start_timeout`, :func:`tee_stderr`,
    :func:`start_worker_processes`,
    :class:`StderrTee`) and the worker loop itself (:class:`Worker`,
    :func:`command_stream`, :class:`HeartbeatSender`, :func:`worker_spin_seconds`:
    how long a worker polls for its next command before it sleeps).
Commands on the wire
    :func:`encode`, :func:`decode` (pickles: pipes from processes you started),
    :func:`encode_for_network` and :func:`decode_untrusted` (the tagged format of
    anything that crosses a socket: nothing is unpickled), :func:`register_wire_type`
    (a type of yours across a network link), :func:`frame_head`,
    :func:`write_frame`, :class:`FrameReader`, :data:`FLAG_BATCH`.
CCLs
    :class:`CCL`, :class:`Rendezvous`, :data:`REDUCE_OPS`, :mod:`validate`
    (the argument checks every collective runs on every member),
    :func:`average_in_place` (``avg`` as NCCL computes it, integers included), and
    :meth:`CCL.preflight` (worker-side checks before a blocking initialisation).
Rendezvous store
    :class:`Store` (``disco_core.worker.current().store`` on every worker:
    ``set``/``get``/``wait``/``add`` on keys, over the session's own channel,
    with a timeout), :class:`StoreTimeoutError`, :func:`store_timeout`
    (``DISCO_STORE_TIMEOUT``), :data:`MAX_KEY_CHARS`, :data:`MAX_VALUE_BYTES`;
    a channel's side: :class:`ControllerStore` (what ``LinkChannel.attach_store``
    wires), :class:`RemoteStore` and :class:`NoStore`.
Network layer
    :mod:`net` (:mod:`~disco_core.net.io`, :mod:`~disco_core.net.framing`,
    :mod:`~disco_core.net.security`, :mod:`~disco_core.net.protect`,
    :mod:`~disco_core.net.accept`): the one security policy
    (:func:`resolve_token`, :func:`check_bind`, :func:`listen_family`, :class:`Handshake`,
    :func:`stretch_token`, :func:`tls_authenticates_peers`,
    :func:`new_nonce`, :data:`TOKEN_ENV`), sealed records
    (:class:`SealedTransport`), transports, byte I/O (:func:`send_all`,
    :func:`write_all`, :func:`recv_exact`, :func:`new_pipe`, :func:`grow_pipe`,
    :data:`CAN_SPLICE`, :data:`PIPE_BYTES`, :func:`splice_exact`, :func:`as_views`,
    :class:`SinkFailedError`; :data:`NONCE_BYTES` and :data:`PROOF_BYTES` of the
    handshake), frame heads (:func:`read_frame_head`,
    :data:`FRAME_PREFIX`) and the one accept loop for work before a peer is
    known (:mod:`accept`: :class:`AcceptLoop`, :class:`SocketHandshake`,
    :class:`PendingConnection`, :class:`StepMachine`, :class:`Drain`,
    :class:`Slots`). :mod:`protocol` holds the command codes.
Devices and lookups
    :class:`Device`, :func:`as_device`, :func:`as_dtype`, :func:`as_shape`,
    :func:`to_host`, :func:`empty`, :func:`lookup` (a registered plugin by kind
    and name), :func:`load_py`, :mod:`registry`.
Commands
    ``commandline``: the options every Disco command has (``--version``,
    ``-v``, ``--log-level``: :func:`add_common_options`, :func:`level_from_args`,
    :func:`configure_logging`) and :class:`HelpFormatter` (defaults shown).
"""

from __future__ import annotations

from . import _interrupts as interrupts
from . import commandline, net, protocol, registry
from .ccl import validate
from .ccl.base import CCL, REDUCE_OPS, Rendezvous, average_in_place
from .channels.base import (
    BatchingLink,
    LinkChannel,
    Outgoing,
    ReaderGate,
    ReplyHub,
    ThreadWorkerLink,
    WorkerLink,
    check_untrusted,
    liveness_timeout,
)
from .channels.process import (
    ProcessWorkerLink,
    ReplyReader,
    exit_reason,
    start_failure,
    start_timeout,
    start_worker_processes,
    stop_worker,
    tee_stderr,
    worker_env,
)
from .channels.stderr_tee import StderrTee
from .commandline import (
    HelpFormatter,
    add_common_options,
    chosen_parser,
    configure_logging,
    level_from_args,
    parse_command_line,
    plain_warnings,
)
from .device import Device, as_device, as_dtype, as_shape, dtype_name, empty, to_host
from .loaders import load_py
from .net import accept
from .net.accept import AcceptLoop, Drain, PendingConnection, Slots, SocketHandshake, StepMachine
from .net.framing import PREFIX as FRAME_PREFIX
from .net.framing import FrameReader, check_frame, read_frame_head
from .net.io import (
    CAN_SPLICE,
    PIPE_BYTES,
    PipeTransport,
    SinkFailedError,
    SocketTransport,
    SSLTransport,
    as_views,
    grow_pipe,
    may_poll_beside,
    new_pipe,
    placement,
    recv_exact,
    send_all,
    splice_exact,
    unfilled_bytearray,
    write_all,
)
from .net.protect import SEND_RECORD_BYTES, SealedTransport
from .net.relay import relay
from .net.security import (
    NONCE_BYTES,
    PROOF_BYTES,
    TOKEN_ENV,
    Handshake,
    SessionKeys,
    check_bind,
    is_loopback,
    listen_family,
    new_nonce,
    resolve_token,
    stretch_token,
    tls_authenticates_peers,
)
from .net.spawn import spawn_worker, worker_argv
from .plugins import lookup
from .protocol import (
    FLAG_BATCH,
    decode,
    encode,
    frame_head,
    write_frame,
)
from .settings import env_seconds
from .store import (
    MAX_KEY_CHARS,
    MAX_VALUE_BYTES,
    ControllerStore,
    NoStore,
    RemoteStore,
    Store,
    StoreTimeoutError,
    store_timeout,
)
from .wire_values import decode_untrusted, encode_for_network, register_wire_type
from .worker import HeartbeatSender, Worker, command_stream
from .worker._poll_first import spin_seconds as worker_spin_seconds

__all__ = [
    # Ctrl-C held back in steps that must not be cut (protect, deliver)
    "interrupts",
    # channels
    "LinkChannel",
    "WorkerLink",
    "ThreadWorkerLink",
    "BatchingLink",
    "ProcessWorkerLink",
    "ReaderGate",
    "ReplyHub",
    "ReplyReader",
    "Outgoing",
    "check_untrusted",
    "worker_env",
    "worker_argv",
    "spawn_worker",
    "exit_reason",
    "stop_worker",
    "start_timeout",
    "liveness_timeout",
    "env_seconds",
    "tee_stderr",
    "start_worker_processes",
    "start_failure",
    "StderrTee",
    "Worker",
    "HeartbeatSender",
    "worker_spin_seconds",
    "command_stream",
    # commands on the wire
    "encode",
    "decode",
    "decode_untrusted",
    "encode_for_network",
    "register_wire_type",
    "frame_head",
    "write_frame",
    "FrameReader",
    "check_frame",
    "read_frame_head",
    "FRAME_PREFIX",
    "FLAG_BATCH",
    "protocol",
    # CCLs
    "CCL",
    "Rendezvous",
    "REDUCE_OPS",
    "average_in_place",
    "validate",
    # rendezvous store
    "Store",
    "StoreTimeoutError",
    "store_timeout",
    "MAX_KEY_CHARS",
    "MAX_VALUE_BYTES",
    "ControllerStore",
    "RemoteStore",
    "NoStore",
    # network layer
    "net",
    "resolve_token",
    "is_loopback",
    "check_bind",
    "tls_authenticates_peers",
    "listen_family",
    "Handshake",
    "stretch_token",
    "SessionKeys",
    "SealedTransport",
    "SEND_RECORD_BYTES",
    "SocketTransport",
    "SSLTransport",
    "PipeTransport",
    "relay",
    "TOKEN_ENV",
    "new_nonce",
    "send_all",
    "write_all",
    "recv_exact",
    "unfilled_bytearray",
    "new_pipe",
    "grow_pipe",
    "placement",
    "may_poll_beside",
    "CAN_SPLICE",
    "PIPE_BYTES",
    "splice_exact",
    "as_views",
    "SinkFailedError",
    "NONCE_BYTES",
    "PROOF_BYTES",
    "accept",
    "AcceptLoop",
    "PendingConnection",
    "StepMachine",
    "SocketHandshake",
    "Drain",
    "Slots",
    # devices and lookups
    "Device",
    "as_device",
    "as_dtype",
    "as_shape",
    "dtype_name",
    "to_host",
    "empty",
    "lookup",
    "load_py",
    "registry",
    # commands
    "commandline",
    "HelpFormatter",
    "add_common_options",
    "level_from_args",
    "plain_warnings",
    "parse_command_line",
    "chosen_parser",
    "configure_logging",
]
