"""Benchmarks behind the ``chaos-bench`` console script. Each prints a table and writes JSON."""
