"""Tests of docs/: what the docs show is current."""
