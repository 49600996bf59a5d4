"""disco-tutorial: the plugin built in the documentation's "Writing a plugin" tutorial.

* the CCL ``"threads"`` (:class:`~disco_tutorial.ccl.ThreadCCL`), for sessions whose
  workers are threads (``ThreadedSession``);
* the channel ``"trace"`` (:class:`~disco_tutorial.channel.TraceChannel`), which
  logs the commands another channel carries.
"""

from .ccl import ThreadCCL
from .channel import TraceChannel, trace_channel

__all__ = ["ThreadCCL", "TraceChannel", "trace_channel"]
