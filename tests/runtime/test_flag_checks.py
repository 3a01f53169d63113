"""The trainer's flag checks (runtime/flag_checks.py): one line each."""

import dataclasses

from lingvo_ext.runtime import flag_checks
from lingvo_ext.runtime import trainer_flags


def _Options(**kwargs):
  return dataclasses.replace(
      trainer_flags.Options(model='lm.TransformerLmTiny', logdir='/tmp/x',
                            run_locally='cpu'),
      **kwargs)


def test_each_bad_flag_is_one_line_naming_it():
  assert flag_checks.Check(_Options(model='')).startswith('--model is required')
  assert flag_checks.Check(_Options(num_cpu_devices=0)) == (
      '--num_cpu_devices=0 must be >= 1.')
  assert flag_checks.Check(_Options(max_steps=-1)) == (
      '--max_steps=-1 must be >= 0.')
  line = flag_checks.Check(_Options(num_cpu_devices=3, worker_split_size=2))
  assert line.startswith('--worker_split_size=2 must divide')
  assert '\n' not in line


def test_good_flags_pass():
  assert flag_checks.Check(_Options(num_cpu_devices=2,
                                    worker_split_size=2)) is None
