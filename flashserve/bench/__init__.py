"""Benchmarks: the serving benchmark (`flashserve bench serve` / `sweep`) and the engine benchmark script."""
