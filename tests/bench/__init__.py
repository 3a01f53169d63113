"""Tests of bench/: the benchmarks run at tiny sizes."""
