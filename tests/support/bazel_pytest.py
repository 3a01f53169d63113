"""Runs one pytest file as a Bazel py_test (the file's path is argv[1])."""

import sys

import pytest

if __name__ == '__main__':
  sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider'] + sys.argv[1:]))
