"""Benchmarks: one experiment per module, each writing JSON/CSV under bench/results/.

A package so that the benches share code by import (`bench.peers`, the report modules) and the tests
can check them; run one from the repository root as `python -m bench.<name>`.
"""
