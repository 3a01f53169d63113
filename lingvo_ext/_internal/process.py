"""Leaving the process from a runner thread."""

import os


def ExitNow(code: int) -> None:
  """Ends the process with `code` at once, from any thread.

  sys.exit in a runner thread ends only that thread; Lingvo's other runner
  threads would go on. os._exit is the documented way out (no cleanup:
  callers flush their logs first).
  """
  os._exit(code)  # pylint: disable=protected-access
