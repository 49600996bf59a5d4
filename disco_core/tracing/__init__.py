"""Tracing: a per-worker timeline of a session (see :mod:`disco_core.tracing.format`)."""
