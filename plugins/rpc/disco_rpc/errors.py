"""Exception types of disco-rpc."""

from __future__ import annotations

from disco_core import AuthenticationError, DiscoError

__all__ = [
    "RPCError",
    "RPCSessionTimeoutError",
    "RPCAuthError",
    "RPCRequestTimeoutError",
    "RPCAttributeError",
    "RPCIsADirectoryError",
    "RPCNotADirectoryError",
    "TransferError",
    "MessageTooLargeError",
    "ProtocolError",
    "DesyncError",
    "FrameTooLargeError",
    "StreamAbortedError",
]


class RPCError(DiscoError):
    """An RPC call failed: a remote exception, a lost connection, a refused session.

    For a remote exception, ``exc_type`` is the remote exception's type name and
    ``remote_traceback`` its formatted traceback; the message names both.
    """

    def __init__(self, message: str, exc_type: str = "", remote_traceback: str = "") -> None:
        self.exc_type = exc_type
        self.remote_message = message
        self.remote_traceback = remote_traceback
        text = f"remote {exc_type}: {message}" if exc_type else message
        if remote_traceback:
            text += f"\n--- remote traceback ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


class RPCSessionTimeoutError(RPCError, TimeoutError):
    """The session ran longer than its ``session_timeout`` and the server ended it."""


class RPCAuthError(RPCError, AuthenticationError):
    """The handshake failed: wrong or missing token, key mismatch, not an RPC server.

    Also a :class:`disco_core.errors.AuthenticationError` (so a ``ConnectionError``
    and a ``PermissionError``).
    """


class RPCRequestTimeoutError(RPCError, TimeoutError):
    """No server of the requested key became free in time (a tracker request)."""


class RPCAttributeError(RPCError, AttributeError):
    """A remote module has no function of that name (TVM raises ``AttributeError``)."""


class RPCIsADirectoryError(RPCError, IsADirectoryError):
    """A remote path names a folder where a file was expected."""


class RPCNotADirectoryError(RPCError, NotADirectoryError):
    """A component of a remote path is not a folder."""


class TransferError(RPCError, OSError):
    """A file ended before the size it declared was copied."""


class MessageTooLargeError(RPCError):
    """A request is larger than the peer's ``max_message_bytes``; nothing was sent."""


class ProtocolError(RPCError, ValueError):
    """A malformed frame (bad tag, truncated field, bad length).

    Also a ``ValueError``, as it was before it became an :class:`RPCError`.
    """


class DesyncError(ProtocolError):
    """The byte stream cannot be framed any more: the connection must be dropped."""


class FrameTooLargeError(DesyncError):
    """A frame declared a size beyond ``max_message_bytes``."""


class StreamAbortedError(RPCError):
    """The sender of a file stream gave up in the middle (its file failed); still in sync."""


# The names before they ended in Error; kept so that older code still imports them.
MessageTooLarge = MessageTooLargeError
Desync = DesyncError
FrameTooLarge = FrameTooLargeError
StreamAborted = StreamAbortedError
