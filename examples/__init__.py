"""Files the README examples use; run the examples from the repository root.

A regular package (not a namespace one), so that ``import examples.mymod`` from the
repository root finds this folder even where some installed distribution ships a
top-level ``examples`` package.
"""
