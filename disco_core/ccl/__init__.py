"""Collective communication libraries (the data plane)."""

from .base import CCL, REDUCE_OPS, Rendezvous

__all__ = ["CCL", "REDUCE_OPS", "Rendezvous"]
