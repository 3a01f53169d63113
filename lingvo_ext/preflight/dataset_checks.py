"""Checks of every dataset a process's jobs read, before anything is written.

The trainer reads `Train`; `evaler_<name>` and `decoder_<name>` read the
experiment's dataset `<name>` (Lingvo's `Dev`, `Test` or any other).
`Check` raises one-line errors for each: its files (`input_files`), its
tokenizers' vocab files (a missing one makes Lingvo's tokenizer retry
forever), and its batches against the pipelines' micro-batching
(`pipeline_tree.CheckPipelines`, every bucket), and a sequence input's
lengths against its buckets (`sequence_checks`). See docs/troubleshooting.md.
"""

import os

import lingvo.compat as tf

from lingvo_ext.tasks import input_files
from lingvo_ext.tasks import pipeline_tree
from lingvo_ext.tasks import sequence_checks


def JobDatasets(jobs, trains):
  """The dataset names that `jobs` read, Train first if `trains`."""
  names = ['Train'] if trains else []
  for job in jobs:
    for prefix in ('evaler_', 'decoder_'):
      if job.startswith(prefix) and job[len(prefix):]:
        name = job[len(prefix):]
        if name not in names:
          names.append(name)
  return names


def _VocabEntries(path, ids_in_file):
  """The ids a vocab file gives: its max id + 1 (or its lines)."""
  with tf.io.gfile.GFile(path) as f:
    lines = [line for line in f.read().splitlines() if line.strip()]
  if not ids_in_file:
    return len(lines)
  size = 0
  for i, line in enumerate(lines):
    fields = line.split('\t') if '\t' in line else line.split()
    if len(fields) >= 2 and fields[-1].lstrip('-').isdigit():
      size = max(size, int(fields[-1]) + 1)
    else:
      size = max(size, i + 1)  # No id column: its line number.
  return size


def CheckVocab(input_params, where):
  """Raises ValueError for a tokenizer vocab file that is missing,
  unreadable, empty or not of the tokenizer's `vocab_size`."""
  for path_key, tok in input_files.Tokenizers(input_params):
    for key in input_files.VOCAB_KEYS:
      if key not in tok or not tok.Get(key):
        continue
      path = tok.Get(key)
      name = f'{path_key}.{key}'
      if '://' in path:
        continue  # A remote file system: left to its reader.
      if not os.path.isfile(path):
        raise ValueError(
            f'{where}: {name}={path!r}: no such file; Lingvo\'s tokenizer '
            'would wait for it forever. Point it at the vocab file (e.g. '
            f"--model_params_override='{name}:\"/path/vocab.txt\"').")
      if not os.access(path, os.R_OK):
        raise ValueError(f'{where}: {name}={path!r} is not readable; make '
                         'it readable or point it at a readable copy.')
      if key == 'spm_model' or 'vocab_size' not in tok:
        continue
      ids = tok.load_token_ids_from_vocab if (
          'load_token_ids_from_vocab' in tok) else False
      try:
        entries = _VocabEntries(path, ids)
      except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f'{where}: {name}={path!r} cannot be read as text '
                         f'({e}); point it at a vocab file.') from e
      if not entries:
        raise ValueError(f'{where}: {name}={path!r} is empty; point it at '
                         'a vocab file with one token per line.')
      if entries != tok.vocab_size:
        raise ValueError(
            f'{where}: {name}={path!r} has {entries} entries but '
            f'{path_key}.vocab_size={tok.vocab_size}; set vocab_size (and the '
            f"model's) to {entries}, or use a vocab of {tok.vocab_size}.")


def CheckDecoder(cfg, job):
  """Raises ValueError if `job` (a decoder) runs a task without a decoder:
  it would have nothing to do."""
  from lingvo.core import base_model  # pylint: disable=g-import-not-at-top
  task = cfg.task if 'task' in cfg else None
  if task is None or not isinstance(task.cls, type):
    return
  if task.cls.CreateDecoderMetrics is base_model.BaseTask.CreateDecoderMetrics:
    dataset = job[len('decoder_'):]
    raise ValueError(
        f'--job={job}: task {task.name} ({task.cls.__name__}) has no decoder '
        '(its CreateDecoderMetrics is empty): nothing to decode; '
        f'--job=evaler_{dataset} evaluates its loss.')


def CheckJobs(jobs, trains, params_fn, num_replicas=1):
  """Raises ValueError (one line) for what the datasets of `jobs` would fail
  on (`Check`), and for a decoder with nothing to decode.

  Args:
    jobs: The process's jobs, e.g. ['evaler_dev'].
    trains: Whether it trains (reads Train).
    params_fn: dataset name -> the experiment's params for it.
    num_replicas: Data-parallel replicas (for messages).
  """
  for dataset in JobDatasets(jobs, trains):
    cfg = params_fn(dataset)
    Check(cfg, dataset, num_replicas)
    if f'decoder_{dataset}' in jobs:
      CheckDecoder(cfg, f'decoder_{dataset}')


def Check(cfg, dataset, num_replicas=1):
  """Raises ValueError (one line) for what dataset `dataset` would fail on.

  Args:
    cfg: The experiment's params for `dataset` (overrides applied).
    dataset: Its name, e.g. 'Dev'.
    num_replicas: Data-parallel replicas (for messages).
  """
  if 'input' not in cfg or cfg.input is None:
    return
  name = cfg.input.name if 'name' in cfg.input else ''
  title = dataset[:1].upper() + dataset[1:]
  where = f'the {title} input ({name})' if name else f'the {title} input'
  if dataset == 'Train':
    input_files.CheckFilePattern(cfg.input)  # Its messages, as before.
  else:
    try:
      input_files.CheckFilePattern(cfg.input)
    except ValueError as e:
      raise ValueError(f'{where}: {e}') from e
  CheckVocab(cfg.input, where)
  sequence_checks.Check(cfg.input, where)
  if dataset != 'Train':
    try:
      pipeline_tree.CheckPipelines(cfg, num_replicas)
    except ValueError as e:
      raise ValueError(f'{where}: {e}') from e
