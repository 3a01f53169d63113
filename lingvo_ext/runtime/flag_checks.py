"""The trainer's checks of its flags, before anything is written.

`Check` returns one error line (the flag and the fix) or None; the trainer
prints it and exits 2. The params' own checks are lingvo_ext/preflight/.
"""

import os

import lingvo.compat as tf

from lingvo_ext import checkpoints
from lingvo_ext import registry
from lingvo_ext.runtime import jit_default
from lingvo_ext.runtime import shutdown
from lingvo_ext.runtime import trainer_lib


def Check(o, worker_replicas=None):
  """The error line for bad flags, or None. `o`: the trainer's Options;
  `worker_replicas`: --worker_replicas where given."""
  if not o.model:
    return ('--model is required, e.g. --model=lm.TransformerLmTiny; list '
            'the models with: .venv/bin/python -m lingvo_ext.tools.list_models')
  error = registry.CheckModel(o.model)
  if error:
    return error
  if o.mode in ('sync', 'async') and not o.logdir:
    return '--logdir is required, e.g. --logdir=/tmp/lingvo_ext/lm'
  if o.num_cpu_devices < 1:
    return f'--num_cpu_devices={o.num_cpu_devices} must be >= 1.'
  if o.intra_op_threads is not None and o.intra_op_threads < 0:
    return (f'--intra_op_threads={o.intra_op_threads} must be >= 0 (0: '
            "TensorFlow's default, a thread per core).")
  if o.max_steps is not None and o.max_steps < 0:
    return f'--max_steps={o.max_steps} must be >= 0.'
  error = jit_default.CheckFlags(o.jit_auto_min_steps)
  if error:
    return error
  if o.shutdown_grace_secs <= 0:
    return (f'--shutdown_grace_secs={o.shutdown_grace_secs:g} must be > 0, '
            'e.g. 20 (below the cluster\'s grace period).')
  error = shutdown.CheckPreemptedCode(o.preempted_exit_code)
  if error:
    return error
  if o.eval_checkpoint and not tf.io.gfile.exists(o.eval_checkpoint +
                                                  '.index'):
    return (f'--eval_checkpoint={o.eval_checkpoint}: no such checkpoint (no '
            f'{o.eval_checkpoint}.index); pass a prefix such as '
            'LOGDIR/train/ckpt-00000100.')
  if o.eval_checkpoint and '://' not in o.eval_checkpoint:
    problem = checkpoints.ReadProblem(o.eval_checkpoint)
    if problem:
      return (f'--eval_checkpoint={o.eval_checkpoint} is a damaged '
              f'checkpoint ({problem}); pass an intact one, or --eval_once '
              'for the newest intact one.')
  if o.eval_one_pass and not (o.eval_once or o.eval_checkpoint):
    return ('--eval_one_pass reads the Dev/Test files once, for one '
            'checkpoint: add --eval_once (or --eval_checkpoint=PREFIX).')
  train_dir = os.path.join(o.logdir, 'train')
  if (o.eval_once and not o.eval_checkpoint and not o.trains_here and
      o.logdir and '://' not in o.logdir and
      not checkpoints.NewestIntactCheckpoint(train_dir)):
    return (f'--eval_once: no checkpoint in {train_dir} to evaluate; train '
            'with the same --logdir first, or pass --eval_checkpoint.')
  other = {'sync': ('trainer', 'trainer_client'),
           'async': ('trainer_client', 'trainer')}.get(o.mode)
  if other and other[0] in o.jobs:
    # Lingvo's cluster asserts on the pair; its traceback names neither.
    jobs = ','.join(other[1] if j == other[0] else j for j in o.jobs)
    return (f'--job={o.job} has job {other[0]}, which --mode={o.mode} does '
            f'not run; its trainer job is {other[1]}: pass --job={jobs}.')
  if o.distributed:
    return trainer_lib.CheckFlags(o, worker_replicas)
  if o.run_locally == 'cpu':
    n, split = o.num_cpu_devices, o.worker_split_size
    if split < 1 or n % split:
      return (f'--worker_split_size={split} must divide '
              f'--num_cpu_devices={n}; to pipeline over {split} CPU devices '
              f'pass --num_cpu_devices={split}.')
  return None
