"""The one network layer: byte I/O, framing with caps, the security policy.

Every channel and service that crosses a pipe or a socket builds on this
package; plugins keep only their own messages. It imports the standard
library, NumPy and :mod:`disco_core.errors`, nothing else of the core.
"""
