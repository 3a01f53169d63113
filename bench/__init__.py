"""Benchmarks for lingvo_ext (run as scripts: python bench/pipeline.py)."""
