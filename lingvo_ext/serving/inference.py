"""A pipelined model's params rewritten as its sequential model on one device.

Params are data: the export rewrites the Params tree before anything is
instantiated, as Lingvo does for its own inference graphs, so a checkpoint
trained on K devices loads as it is:

- a lingvo_ext `PipelinedTask` becomes one cell over one micro-batch
  (`num_partitions=1`, `num_micro_batches=1`), without stacked variables or
  XLA; its variable names do not depend on the cut
  (`partition_independent_names`), and a stacked checkpoint keeps per-layer
  names, so the same checkpoint restores;
- any other `PipeliningLayer` in the tree (Lingvo's task code, rewritten by
  `from_lingvo`) keeps its cells, whose names are in the checkpoint, and
  runs them over one micro-batch;
- every `*dropout_prob` is 0: inference is deterministic;
- every `partitioner` is None: one device holds each variable whole, which
  restores from the trainer's sliced save of a partitioned variable (the
  trainer writes those with TF's Saver, under the whole variable's name).

With one device and `do_eval` (Lingvo's exporter sets both), the pipeline
runs its cells in sequence on the whole batch (`FPropSequential`): no
micro-batches, no cell functions, no other devices.
"""

from lingvo.core import hyperparams

from lingvo_ext.tasks import experiment_params
from lingvo_ext.tasks import pipeline_tree

# Pipeline params that make sense only for training several cells at once.
_PIPELINE_SETTINGS = (('num_micro_batches', 1), ('micro_batch_size', None),
                      ('stack_variables', False), ('jit_compile', False),
                      ('recompute', None))


def _ForInference(value):
  """Sets every numeric `*dropout_prob` under `value` to 0, and every
  `partitioner` to None."""
  if isinstance(value, hyperparams.Params):
    for name, sub in value.IterParams():
      if (name.endswith('dropout_prob') and isinstance(sub, (int, float)) and
          not isinstance(sub, bool)):
        value.Set(**{name: 0.0})
      elif name == 'partitioner' and sub is not None:
        value.Set(partitioner=None)
      else:
        _ForInference(sub)
  elif isinstance(value, dict):
    for sub in value.values():
      _ForInference(sub)
  elif isinstance(value, (list, tuple)):
    for sub in value:
      _ForInference(sub)


def SequentialParams(cfg):
  """A copy of model params `cfg` as its one-device sequential model.

  Args:
    cfg: An experiment's model params (e.g.
      `experiment_params.GetParams(m, 'Train')`).

  Returns:
    The rewritten copy; `cfg` is left as it is.
  """
  cfg = cfg.Copy()
  task = cfg.task if 'task' in cfg else None
  if task is not None and pipeline_tree.IsPipelinedTask(task):
    task.Set(num_partitions=1, num_micro_batches=1, stack_variables=False,
             jit_compile=False, recompute=None, gradient_sync='shared',
             accumulate_steps=1)
    if task.partition_cost == 'time':  # Cutting one cell needs no timing.
      task.partition_cost = 'flops'
  for _, p in pipeline_tree.Pipelines(cfg):
    for name, value in _PIPELINE_SETTINGS:
      if name in p:
        p.Set(**{name: value})
  _ForInference(cfg)
  return cfg


def InferenceParams(model, overrides='', gpipe_engine='lingvo_ext',
                    vocab_file=''):
  """The params to export registered `model` with.

  The training params (their input gives the shapes and the vocabulary the
  task was trained with), rewritten by `SequentialParams`.

  Args:
    model: A registered name, e.g. 'lm.TransformerLmTinyGPipe'.
    overrides: A --model_params_override text.
    gpipe_engine: --gpipe_engine ('lingvo_ext' or 'lingvo').
    vocab_file: A vocab.json the input should load ('' to leave it).

  Raises:
    LookupError: `model` is not registered.
    ValueError: a bad override.
  """
  cfg = experiment_params.GetParams(model, 'Train', overrides, '', gpipe_engine)
  if vocab_file and 'input' in cfg and cfg.input is not None and (
      'vocab_file' in cfg.input):
    cfg.input.vocab_file = vocab_file
  return SequentialParams(cfg)
