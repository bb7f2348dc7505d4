"""Benchmarks (`make bench`): every `bench_*.py` module here is one section; see __main__.py."""
