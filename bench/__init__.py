"""Benchmarks of genscore against its peers (not part of the test suite); `python -m bench.bench --help`."""
