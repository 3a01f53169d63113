"""What the user-path tests share (tests/e2e/test_user_path.py and
tests/e2e/test_user_overrides.py): trainer runs as a user starts them, the
Tiny experiment they train, the lines no run may print."""

import concurrent.futures
import os
import re
import shutil
import subprocess
import sys

import lingvo.compat as tf

from lingvo_ext.tasks import experiment_params
from tests.support import ROOT
from tests.support import zygote

TIMEOUT = 300
TINY = 'lm.TransformerLmTinyGPipe'
TRAINED_STEPS = 4
# Every shipped experiment with more than one pipeline cell.
TINY_GPIPE_EXPERIMENTS = ['lm.TransformerLmTinyGPipe',
                          'image.ConvClassifierTinyGPipe']
ERROR_LINES = ('Traceback', 'Object was never used', 'Logging error',
               'I/O operation on closed file')


def Run(args, cwd=ROOT, pythonpath=None, timeout=TIMEOUT, module=True,
        fresh=False):
  """(exit code, stdout, stderr) of `python -m args...` (module=False: of
  args), forked (zygote) unless fresh."""
  env = dict(os.environ)
  env['PYTHONPATH'] = pythonpath or ROOT
  cmd = [sys.executable, '-m', *args] if module else list(args)
  run = subprocess.run if fresh else zygote.run
  proc = run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
             timeout=timeout, check=False)
  return proc.returncode, proc.stdout, proc.stderr


def Train(*flags, **kwargs):
  return Run(['lingvo_ext.trainer', *flags], **kwargs)


def TrainAll(flag_lists):
  """Train of each list of flags, several at once where cores allow."""
  workers = max(1, min(4, (os.cpu_count() or 2) // 4))
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    return list(pool.map(lambda flags: Train(*flags), flag_lists))


def Losses(stdout):
  """{step: loss} of the trainer's progress lines."""
  return {int(s): float(l) for s, l in re.findall(
      r'^step (\d+)/\d+  loss (\S+)', stdout, re.M)}


def NoErrorLines(*texts):
  for text in texts:
    for bad in ERROR_LINES:
      assert bad not in text, text[-3000:]


def Flags():
  flags = tf.flags.FLAGS
  if not flags.is_parsed():
    flags.mark_as_parsed()
  return flags


def Params(model, override=''):
  return experiment_params.GetParams(model, 'Train', override)


def Copy(logdir, tmp_path):
  copy = str(tmp_path / 'copy')
  shutil.copytree(logdir, copy)
  return copy
