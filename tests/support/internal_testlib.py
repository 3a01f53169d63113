"""What the tests of tests/_internal/ share: a failure that names the symbol."""

import pytest

from lingvo_ext import _internal


def Gone(symbol, error):
  """The failure line: the symbol, the versions and what to update."""
  return (f'{symbol} changed or is gone in this TensorFlow/Lingvo '
          f'({", ".join(_internal.VersionMismatches()) or "pinned versions"}):'
          f' {type(error).__name__}: {error}; update lingvo_ext/_internal.')


def Check(symbol, fn):
  """Calls fn; a failure names the symbol (Gone)."""
  try:
    fn()
  except Exception as e:  # pylint: disable=broad-except
    pytest.fail(Gone(symbol, e))
