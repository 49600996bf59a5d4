"""Control-plane channels: the interface and the core's threaded and process channels."""

from .base import Channel, LinkChannel, Outgoing, ReplyHub, ThreadWorkerLink, WorkerLink

__all__ = ["Channel", "LinkChannel", "Outgoing", "ReplyHub", "ThreadWorkerLink", "WorkerLink"]
