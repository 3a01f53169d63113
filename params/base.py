"""The shared shape of lingvo_ext's pipelined experiments (not registered)."""

from lingvo.core import base_model_params

from lingvo_ext.tasks.in_memory_input import InMemoryInput


class PipelinedExperiment(base_model_params.SingleTaskModelParams):
  """Train/Dev inputs and the pipeline and training settings of a task.

  Subclasses implement `_InputParams(split)` and `_TaskParams()`, and set the
  class attributes below.
  """

  NUM_PARTITIONS = 1
  NUM_MICRO_BATCHES = 1
  # Checkpoints restore under any NUM_PARTITIONS (see SeqLayer's param).
  PARTITION_INDEPENDENT_NAMES = True
  LEARNING_RATE = 1e-3
  MAX_STEPS = 1000
  SAVE_INTERVAL_SECONDS = 120
  SUMMARY_INTERVAL_STEPS = 50
  # The dtype the layers compute in (task.fprop_dtype): None (float32) or
  # 'bfloat16' (float32 variables, optimizer and checkpoints); per run:
  # --model_params_override='task.fprop_dtype:bfloat16'.
  FPROP_DTYPE = None

  def _InputParams(self, split):
    """The input generator params of `split` ('train' or 'dev')."""
    raise NotImplementedError(type(self).__name__)

  def _TaskParams(self):
    """The task params, before the settings that Task() applies."""
    raise NotImplementedError(type(self).__name__)

  def _Input(self, split):
    p = self._InputParams(split)
    if split != 'train':
      InMemoryInput.SetOnePass(p)  # Dev is scored as one whole pass.
    return p

  def Train(self):
    return self._Input('train')

  def Dev(self):
    return self._Input('dev')

  def Task(self):
    p = self._TaskParams().Set(
        num_partitions=self.NUM_PARTITIONS,
        num_micro_batches=self.NUM_MICRO_BATCHES,
        partition_independent_names=self.PARTITION_INDEPENDENT_NAMES)
    if self.FPROP_DTYPE is not None:
      p.fprop_dtype = self.FPROP_DTYPE
    tp = p.train
    tp.learning_rate = self.LEARNING_RATE
    tp.max_steps = self.MAX_STEPS
    tp.save_interval_seconds = self.SAVE_INTERVAL_SECONDS
    tp.summary_interval_steps = self.SUMMARY_INTERVAL_STEPS
    return p
