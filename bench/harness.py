"""What every bench shares: its command line's tail, its output, its rounds.

A bench (bench/*.py) defines its own flags and measurement; the harness gives
the rest, the same in each:

- `Parser(doc)`: the ArgumentParser, described by the bench docstring's first
  line, with `--markdown` (a table instead of JSON lines).
- `CheckPositive(parser, args, names)`: `--name must be >= 1` (exit 2).
- `RoundRobin(steps, rounds)`: each variant's step timed in turn, round after
  round, so load that comes and goes on a shared machine hits every variant
  alike (a bench's figures are ratios taken side by side).
- `Table(header, rows)`: a markdown table.
- `Emit(args, records, markdown)`: one JSON line per record, or with
  --markdown the table `markdown(records)` makes.
- `Machine()`: the machine a figure names (CPU model, cores, load average).

Pure Python: bench/torch_baselines.py runs in the torch venv, without
TensorFlow. docs/benchmarks.md shows each bench's command.
"""

import argparse
import json
import os
import platform
import time
from typing import Callable
from typing import Dict
from typing import List
from typing import Sequence


def Parser(doc: str, raw: bool = False,
           markdown_help: str = 'Print a markdown table instead of JSON lines.'
           ) -> argparse.ArgumentParser:
  """The bench's parser with --markdown; `raw` keeps the epilog's layout."""
  kwargs = {}
  if raw:
    kwargs['formatter_class'] = argparse.RawDescriptionHelpFormatter
  parser = argparse.ArgumentParser(description=doc.strip().split('\n')[0],
                                   **kwargs)
  parser.add_argument('--markdown', action='store_true', help=markdown_help)
  return parser


def CheckPositive(parser: argparse.ArgumentParser, args,
                  names: Sequence[str]) -> None:
  """Exits 2 with one line if a flag in `names` is below 1."""
  for name in names:
    value = getattr(args, name)
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
      if v is not None and v < 1:
        parser.error(f'--{name} must be >= 1, got {v}.')


def RoundRobin(steps: Sequence[Callable[[], object]],
               rounds: int) -> List[List[float]]:
  """Seconds of each step over `rounds` rounds, the steps taken in turn."""
  times = [[] for _ in steps]
  for _ in range(rounds):
    for i, step in enumerate(steps):
      start = time.perf_counter()
      step()
      times[i].append(time.perf_counter() - start)
  return times


def Table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
  """A markdown table: the header, its rule and a line per row."""
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  lines += ['| ' + ' | '.join(str(c) for c in row) + ' |' for row in rows]
  return '\n'.join(lines)


def Emit(args, records: Sequence[Dict],
         markdown: Callable[[Sequence[Dict]], str]) -> None:
  """Prints the records: JSON lines, or with --markdown their table."""
  if getattr(args, 'markdown', False):
    print(markdown(records), flush=True)
  else:
    for r in records:
      print(json.dumps(r), flush=True)


def Machine() -> Dict[str, object]:
  """The CPU model, its cores and the 1-minute load average, for a figure."""
  model = platform.processor() or platform.machine()
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          model = line.split(':', 1)[1].strip()
          break
  except OSError:
    pass
  return dict(cpu=model, cores=os.cpu_count(),
              load=round(os.getloadavg()[0], 2))
