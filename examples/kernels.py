"""A module for the disco-rpc examples: uploaded to a server and loaded there."""


def scale(out, x, a):
    """``out[:] = a * x``; remote tensors arrive as the server's own arrays."""
    out[:] = a * x
