"""Pipelined Transformer language model task."""
