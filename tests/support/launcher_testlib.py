"""What the Launcher's tests share: an output that keeps its lines, and a
run of the Launcher that always stops its tasks."""


class Lines:
  """A stream for the Launcher's output; `lines` holds its non-empty lines."""

  def __init__(self):
    self.lines = []

  def write(self, text):
    self.lines.extend(l for l in text.splitlines() if l)

  def flush(self):
    pass


def Run(launcher):
  """Starts the launcher's tasks and watches them; stops them however it
  ends. Returns what Watch returns."""
  try:
    launcher.StartAll()
    return launcher.Watch(poll_s=0.05)
  finally:
    launcher.StopAll(grace_s=5)
    launcher.Flush()
