"""How tests/e2e/test_docs_examples.py checks a `checked: commands` block.

The block runs with fakes for the venv's python and for bash that record
each command (`FAKE_PYTHON`); `CheckCommandsMain` then puts each recorded
command through the checks its program makes before it does anything: the
trainer's flag, cluster, model and params checks (`CheckTrainerArgv`), or a
script's argparse parser (`CheckArgparseArgv`).
"""

import os

from tests.support import ROOT

# What a `checked: commands` block runs instead of the venv's python (and
# of bash, for the scripts it starts): it records each command (its
# PYTHONPATH and arguments), one JSON line each.
FAKE_PYTHON = """#!%s
import json, os, sys
with open(os.environ['DOCS_COMMANDS'], 'a') as f:
  f.write(json.dumps([os.environ.get('PYTHONPATH', ''),
                      [os.path.basename(sys.argv[0])] + sys.argv[1:]]) + '\\n')
"""


class _Parsed(Exception):
  pass


def CheckArgparseArgv(argv):
  """Whether a script's argparse parser takes argv, without running it.

  Args:
    argv: ['bench/x.py', args...] or ['-m', 'module', args...].

  Returns:
    The parser's error message, or None.
  """
  # pylint: disable=g-import-not-at-top
  import argparse
  import contextlib
  import io
  import runpy
  import sys
  parse, parse_known = (argparse.ArgumentParser.parse_args,
                        argparse.ArgumentParser.parse_known_args)
  inside = []

  def ParseThenStop(self, args=None, namespace=None):
    inside.append(1)  # parse_args calls parse_known_args: let it.
    parse(self, args, namespace)
    raise _Parsed()

  def ParseKnownThenStop(self, args=None, namespace=None):
    if inside:
      return parse_known(self, args, namespace)
    parse_known(self, args, namespace)
    raise _Parsed()

  if argv[0] == '-m':
    if not argv[1].startswith('lingvo_ext.'):
      return 'only lingvo_ext modules are checked, not %s' % argv[1]
    run, target, args = runpy.run_module, argv[1], argv[2:]
  elif not argv[0].startswith('bench/'):
    return 'only bench/ scripts are checked, not %s' % argv[0]
  else:
    run, target, args = runpy.run_path, os.path.join(ROOT, argv[0]), argv[1:]
    if not os.path.exists(target):
      return 'no such script: %s' % argv[0]
  err = io.StringIO()
  argparse.ArgumentParser.parse_args = ParseThenStop
  argparse.ArgumentParser.parse_known_args = ParseKnownThenStop
  old_argv = sys.argv
  sys.argv = [target] + list(args)
  try:
    with contextlib.redirect_stderr(err):
      run(target, run_name='__main__')
  except _Parsed:
    return None
  except SystemExit as e:
    return 'exit %s: %s' % (e.code, err.getvalue().strip()[-500:])
  finally:
    argparse.ArgumentParser.parse_args = parse
    argparse.ArgumentParser.parse_known_args = parse_known
    sys.argv = old_argv
  return 'it ran to the end without parsing its arguments'


def CheckTrainerArgv(argv):
  """The trainer's checks of one command line, as its Run makes them.

  Flags, cluster resolution, the model and its params (with the overrides);
  nothing is written, so no logdir is locked or made.

  Returns:
    The trainer's error message, or None.
  """
  # pylint: disable=g-import-not-at-top,protected-access
  import lingvo.compat as tf

  from lingvo_ext import trainer
  from lingvo_ext.preflight import param_checks
  from lingvo_ext.runtime import flag_checks
  from lingvo_ext.runtime import trainer_flags
  from lingvo_ext.runtime import trainer_lib
  flags = trainer.FLAGS
  flags.unparse_flags()
  trainer_flags.SetTrainerDefaults()
  try:
    flags(['lingvo_ext.trainer'] + list(argv))
  except tf.flags.Error as e:
    return ' '.join(str(e).split())
  resolved, error = trainer_lib.ResolveCluster(
      flags.cluster_resolver, flags.mode, flags.slurm_port_base,
      [f'--{n}' for n in ('cluster_spec', 'job', 'task') if flags[n].present])
  if error:
    return error
  if resolved:
    flags.cluster_spec = resolved.cluster_spec
    flags.job = resolved.job
    flags.task = resolved.task
  if flags.cluster_spec:
    flags.set_default('run_locally', '')
  o = trainer_flags.Options.FromFlags()
  error = flag_checks.Check(o, flags.worker_replicas if
                            flags['worker_replicas'].present else None)
  if not error:
    error, o = param_checks.Check(o)
  return error


def CheckCommandsMain():
  """Reads [argv or {env, argv}, ...] as JSON on stdin; prints each error.

  Returns 1 if any command failed its checks, else 0.

  An argv is ['-m', 'lingvo_ext.trainer', flags...] (the trainer's checks),
  or a script's or module's argparse command line (its parser's).
  """
  import json  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, ROOT)  # For bench/'s `from bench import ...`.
  failed = 0
  for argv in json.load(sys.stdin):
    if isinstance(argv, dict):  # {'env': the task's environment, 'argv'}.
      for name in list(os.environ):
        if name == 'TF_CONFIG' or name.startswith('SLURM_'):
          del os.environ[name]
      os.environ.update(argv['env'])
      argv = argv['argv']
    if argv[:2] == ['-m', 'lingvo_ext.trainer']:
      error = CheckTrainerArgv(argv[2:])
    else:
      error = CheckArgparseArgv(argv)
    print('%s: %s' % (' '.join(argv), error or 'ok'), flush=True)
    failed += bool(error)
  return 1 if failed else 0
