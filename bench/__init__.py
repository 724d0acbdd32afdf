"""Benchmarks: the kernel sweeps (pytest-benchmark, bench/test_*.py), the step benchmark and their tools."""
