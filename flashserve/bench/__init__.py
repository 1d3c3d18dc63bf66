"""Benchmark scripts (not tests)."""
