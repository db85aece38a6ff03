"""Benchmarks and device harnesses. A package so that the kernel self-checks (`bench.selfcheck*`) import from
tests and run as `python -m bench.selfcheck_gemv` from the repository root; the scripts beside them run by path."""
