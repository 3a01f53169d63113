"""A quiet first line: TensorFlow's start-up noise kept off stderr.

Importing TensorFlow prints C++ lines before its logging is set up, where
TF_CPP_MIN_LOG_LEVEL does not reach them (absl's "All log messages before
absl::InitializeLog()", cudart_stub's "Could not find cuda drivers", oneDNN's
notice, once per library that loads them), and the first look at the devices
an E-level "failed call to cuInit ... (303)" on a host without a GPU driver.
None of them is about the user's run. `Install` (called by the programs, through
`lingvo_ext.entry_point`) makes the first `import tensorflow` of the process run with
file descriptor 2 going through a filter that drops exactly those lines and
passes every other line on as it comes; the filter also looks at the devices
once (where the cuInit line comes from) and then steps aside. Lingvo's
warnings that repeat once per variable or cell show once (`RepeatFilter`).

Nothing is filtered when the user set TF_CPP_MIN_LOG_LEVEL: their setting
wins (TF_CPP_MIN_LOG_LEVEL=0 shows TensorFlow's start-up as it is).
"""

import atexit
import contextlib
import importlib.abc
import logging
import os
import re
import subprocess
import sys
import threading

LEVEL_VAR = 'TF_CPP_MIN_LOG_LEVEL'
# The level we set, so that processes we start tell it from the user's.
_MARK = 'LINGVO_EXT_DEFAULT_TF_LOG_LEVEL'

# Lines TensorFlow prints on every start, none of them about the run.
_NOISE = (
    re.compile(r'^WARNING: All log messages before absl::InitializeLog\(\) is '
               r'called are written to STDERR$'),
    re.compile(r'^I\d{4} [\d:. ]+\d+ cudart_stub\.cc:\d+\] Could not find '
               r'cuda drivers on your machine, GPU will not be used\.$'),
    re.compile(r'^I\d{4} [\d:. ]+\d+ \w+\.cc:\d+\] oneDNN custom operations '
               r'are on\. '),
)
# cuInit's failure is noise only where cudart found no driver: with one
# installed it is a real error.
_NO_DRIVER = _NOISE[1]
_CUINIT = re.compile(r'^E\d{4} [\d:. ]+\d+ cuda_platform\.cc:\d+\] failed '
                     r'call to cuInit: .*\(303\)$')


class LineFilter:
  """Drops the known start-up lines of the text written to it."""

  def __init__(self, write):
    self._write = write
    self._partial = b''
    self.no_driver = False
    self.dropped = 0

  def Feed(self, data: bytes):
    lines = (self._partial + data).split(b'\n')
    self._partial = lines.pop()
    for line in lines:
      self._Line(line + b'\n')

  def Close(self):
    if self._partial:
      self._Line(self._partial)
      self._partial = b''

  def _Line(self, line: bytes):
    text = line.decode('utf-8', 'replace').rstrip('\n')
    if _NO_DRIVER.match(text):
      self.no_driver = True
    if any(p.match(text) for p in _NOISE) or (
        self.no_driver and _CUINIT.match(text)):
      self.dropped += 1
      return
    self._write(line)


@contextlib.contextmanager
def FilteredStderr():
  """File descriptor 2 through a LineFilter for the duration of the block.

  Lines are passed on as they come (a thread reads the pipe), so output up
  to a crash inside the block is not held back.
  """
  saved = os.dup(2)
  read_fd, write_fd = os.pipe()

  def Write(line):
    os.write(saved, line)

  line_filter = LineFilter(Write)

  def Forward():
    while True:
      data = os.read(read_fd, 65536)
      if not data:
        break
      line_filter.Feed(data)
    line_filter.Close()

  for stream in (sys.stdout, sys.stderr):
    stream.flush()
  os.dup2(write_fd, 2)
  os.close(write_fd)
  thread = threading.Thread(target=Forward, name='startup-stderr',
                            daemon=True)
  thread.start()
  try:
    yield line_filter
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)  # Closes the pipe's last write end: EOF to Forward.
    # A subprocess started in the block may hold the write end; its lines
    # then stay with it.
    thread.join(10)
    if not thread.is_alive():
      os.close(read_fd)
    os.close(saved)


class _TensorFlowFinder(importlib.abc.MetaPathFinder):
  """Runs the process's first `import tensorflow` through FilteredStderr."""

  def find_spec(self, fullname, path, target=None):
    del path, target
    if fullname != 'tensorflow':
      return None
    Uninstall()
    spec = None
    for finder in sys.meta_path:
      spec = getattr(finder, 'find_spec', lambda *a: None)(fullname, None)
      if spec is not None:
        break
    if spec is None or spec.loader is None:
      return spec
    spec.loader = _QuietLoader(spec.loader)
    return spec


class _QuietLoader(importlib.abc.Loader):
  """Wraps TensorFlow's loader: its import and first device look, filtered."""

  def __init__(self, loader):
    self._loader = loader

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def __getattr__(self, name):
    return getattr(self._loader, name)

  def exec_module(self, module):
    # TensorFlow's module keeps its own loader (resource readers use it).
    module.__loader__ = module.__spec__.loader = self._loader
    with FilteredStderr():
      self._loader.exec_module(module)
      # The first look at the devices prints the cuInit line; it is cached.
      module.config.list_physical_devices('GPU')


_FINDER = _TensorFlowFinder()

# Lingvo's warnings that repeat once per variable or cell: the first is
# shown, with what it means; the rest would only repeat it.
_ONCE = (
    ('is using the default xavier initializer',
     ' (Lingvo says this of every variable its params leave at the default'
     ' init; further ones are not logged.)'),
    ('cell_fn contains stateful ops',
     ' (Lingvo warns of this once per cell function, e.g. for its'
     ' CheckNumerics; further cells are not logged.)'),
)


# Lingvo's batch_major_attention Builder warns "attention param K overriding:
# A -> B" each time it fills an attention template from its own params, for
# every layer; harmless where A is the template's default (or equals B).
_ATTEN_OVERRIDE = re.compile(r'attention param (\w+) overriding: (.*) -> (.*)$')
_ATTEN_DEFAULTS = {'input_dim': '0', 'hidden_dim': '0', 'num_heads': '1',
                   'atten_dropout_prob': '0.0', 'name': ''}
_ATTEN_NOTE = (' (Lingvo says this whenever a Builder fills its attention'
               " template's default dims, heads or name from its own params,"
               ' as intended; further ones are not logged, others are.)')


def _HarmlessAttentionOverride(message: str) -> bool:
  match = _ATTEN_OVERRIDE.search(message)
  if not match:
    return False
  key, old, new = match.groups()
  return old.strip() == new.strip() or (
      _ATTEN_DEFAULTS.get(key) == old.strip())


class RepeatFilter(logging.Filter):
  """Lets the first of each of Lingvo's repeated warnings through, noted."""

  def __init__(self):
    super().__init__()
    self.seen = set()

  def filter(self, record):
    try:
      message = record.getMessage()
    except Exception:  # pylint: disable=broad-except
      return True
    for key, note in _ONCE:
      if key in message:
        if key in self.seen:
          return False
        self.seen.add(key)
        record.msg, record.args = message + note, ()
    if _HarmlessAttentionOverride(message):
      if _ATTEN_NOTE in self.seen:
        return False
      self.seen.add(_ATTEN_NOTE)
      record.msg, record.args = message + _ATTEN_NOTE, ()
    return True


_REPEATS = RepeatFilter()


def Install():
  """Filters the first `import tensorflow` unless the user set the level.

  Also sets TF_CPP_MIN_LOG_LEVEL=2 (TensorFlow's C++ info logs are noise for
  users) where the user did not set it.
  """
  # Lingvo logs through TensorFlow's logger or absl's, by module.
  for logger in (logging.getLogger('tensorflow'), logging.getLogger('absl')):
    if _REPEATS not in logger.filters:
      logger.addFilter(_REPEATS)
  # Set by us (in this process or the one that started it), or the user's.
  level = os.environ.get(LEVEL_VAR)
  if level is not None and level != os.environ.get(_MARK):
    return
  os.environ[LEVEL_VAR] = os.environ[_MARK] = '2'
  if 'tensorflow' not in sys.modules and _FINDER not in sys.meta_path:
    sys.meta_path.insert(0, _FINDER)


# Grappler's E-level lines for a graph whose control edges it reads as
# cycles: the list schedules order micro-batches by control edges between the
# cells' gradients, and Grappler's graph view merges them node by node. It
# then skips its remapper and the transitive reduction of its dependency
# optimizer for that graph; the step computes the same values.
GRAPPLER_CYCLES = (
    r'^E\d{4} [\d:. ]+\d+ meta_optimizer\.cc:\d+\] remapper failed: '
    r'INVALID_ARGUMENT: MutableGraphView::SortTopologically error: detected '
    r'edge\(s\) creating cycle\(s\)',
    r'^E\d{4} [\d:. ]+\d+ dependency_optimizer\.cc:\d+\] Iteration = \d+, '
    r"topological sort failed with message: The graph couldn't be sorted in "
    r'topological order\.$',
)
# TensorFlow's XLA compile cache (xla_cache.py) reads each entry as text,
# then as the binary it is: protobuf logs the text attempt's failure at E
# level on every cache hit. Dropped without a note: a pattern that starts
# with QUIET (a regex comment; _FILTER_PROGRAM spells it out) is not noted.
QUIET = '(?#quiet)'
XLA_CACHE_READS = (
    QUIET + r'^E\d{4} [\d:. ]+\d+ text_format\.cc:\d+\] Error parsing '
    r'text-format tensorflow\.XlaSerializedCacheEntry: ',
)
GRAPPLER_NOTE = (
    "note: TensorFlow's Grappler reads the schedule's ordering edges between "
    'micro-batches as cycles, so it skips its remapper and its dependency '
    'pruning on this graph (its E-lines are not shown; '
    'TF_CPP_MIN_LOG_LEVEL=0 shows them). Harmless: the step computes the same '
    'values.')

# The filter's own process (stdlib only, started with -S): it outlives an
# os._exit or a crash of the trainer long enough to pass on every line
# written before it, and ignores the signals meant for the trainer.
_FILTER_PROGRAM = r"""
import os, re, signal, sys
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
  signal.signal(s, signal.SIG_IGN)
note, pats = sys.argv[1].encode() + b'\n', [re.compile(p) for p in sys.argv[2:]]
noted, held, passing, ok = False, b'', False, True
def Out(data):
  global ok
  while ok and data:
    try:
      data = data[os.write(1, data):]
    except InterruptedError:
      pass
    except OSError:
      ok = False  # Nowhere to write: drain, so the writer never blocks.
while True:
  try:
    data = os.read(0, 65536)
  except InterruptedError:
    continue
  if not data:
    break
  if passing:  # The rest of a line already passed on in part.
    end = data.find(b'\n')
    if end < 0:
      Out(data)
      continue
    Out(data[:end + 1])
    data, passing = data[end + 1:], False
  lines = (held + data).split(b'\n')
  held = lines.pop()
  for line in lines:
    hit = next((p for p in pats if p.match(line.decode('utf-8', 'replace'))),
               None)
    if hit:
      if not noted and not hit.pattern.startswith('(?#quiet)'):
        noted = True
        Out(note)
      continue
    Out(line + b'\n')
  if held and not held.startswith(b'E'):  # Not one of those: pass it now.
    Out(held)
    held, passing = b'', True
Out(held)
"""


def FilterHarmlessLines():
  """Runs the rest of the process with fd 2 through a filter of its own.

  The filter drops Grappler's cycle lines (GRAPPLER_CYCLES), says once what
  they mean (GRAPPLER_NOTE), drops the XLA cache's reads (XLA_CACHE_READS)
  and passes every other byte on as it comes.
  Nothing is filtered where the user set TF_CPP_MIN_LOG_LEVEL. For entry
  points only (the trainer calls it once its checks passed).

  Returns:
    The filter's Popen, or None where nothing is filtered.
  """
  if os.environ.get(LEVEL_VAR) != os.environ.get(_MARK):
    return None
  for stream in (sys.stdout, sys.stderr):
    stream.flush()
  read_fd, write_fd = os.pipe()
  try:
    proc = subprocess.Popen(
        [sys.executable, '-S', '-c', _FILTER_PROGRAM, GRAPPLER_NOTE,
         *GRAPPLER_CYCLES, *XLA_CACHE_READS], stdin=read_fd, stdout=2,
        close_fds=True)
  except OSError:
    os.close(read_fd)
    os.close(write_fd)
    return None
  os.close(read_fd)
  saved = os.dup(2)
  os.dup2(write_fd, 2)
  os.close(write_fd)

  def Restore():
    # The pipe's last write end closed: the filter passes on what it has
    # and exits; waited for so that no line comes after the process ends.
    try:
      sys.stderr.flush()
    except (OSError, ValueError):
      pass
    os.dup2(saved, 2)
    os.close(saved)
    try:
      proc.wait(10)
    except subprocess.TimeoutExpired:  # A child of ours still writes to it.
      pass

  atexit.register(Restore)
  return proc


def Uninstall():
  if _FINDER in sys.meta_path:
    sys.meta_path.remove(_FINDER)
