"""Benchmarks, each runnable as `python -m strata_jax.benchmarks.<name>`."""
