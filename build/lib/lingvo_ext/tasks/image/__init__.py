"""Pipelined convolutional image classification task."""
