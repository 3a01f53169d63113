"""Benchmarks for lingvo_ext.

Run them as scripts, e.g. .venv/bin/python bench/pipeline.py --quick.
"""
