"""A Lingvo task whose layer stack runs as a GPipe pipeline."""

from lingvo.core import base_model

from lingvo_ext.core import gpipe
from lingvo_ext.core import stacking


class PipelinedTask(base_model.BaseTask):
  """Cuts the stack from `LayerStack` into cells and pipelines them.

  Subclasses define `LayerStack(task_params)`; the pipeline is the child
  `pipeline`, to be run in `ComputePredictions`.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
        'num_partitions', 1, 'Number of pipeline cells K the stack is cut '
        'into. To run them in parallel, give the worker K devices '
        '(--worker_split_size=K, with --num_cpu_devices=K on CPU).')
    p.Define(
        'num_micro_batches', 1, 'Micro-batches per batch in the pipeline; '
        'must divide the input batch_size.')
    p.Define(
        'partition_cost', 'flops', 'What PartitionSequentialLayers balances: '
        'flops, params or time.')
    p.Define(
        'partition_independent_names', True,
        'Passed to the PipeliningLayer: True names cell variables without '
        'the cell scope, so a checkpoint trained at one num_partitions '
        'restores at any other; False gives lingvo.core.gpipe\'s names '
        '(convert between the two with '
        '`python -m lingvo_ext.tools.convert_checkpoint`).')
    p.Define(
        'stack_variables', False,
        'Stack the same-shape variables of the layers in each pipeline cell '
        'into one variable per group (e.g. '
        "--model_params_override='task.stack_variables:True'): fewer "
        'variables, ops and optimizer update ops, the same numbers. The '
        'optimizer slots are stacked too, and checkpoints keep the '
        'per-layer names, so they restore into the stacked and the '
        'unstacked model alike. See lingvo_ext/core/stacking.py.')
    p.Define(
        'max_combined_variable_size',
        stacking.DEFAULT_MAX_COMBINED_VARIABLE_SIZE,
        'stack_variables=True: the largest stacked variable, in bytes; '
        'bigger groups are split.')
    p.train.clip_gradient_norm_to_value = 1.0
    return p

  @classmethod
  def _CheckHasInput(cls, task_params):
    """LayerStack needs the input's batch shape; say where to get it."""
    if task_params.input is None:
      raise ValueError(
          f'{task_params.name}: task params have no input; LayerStack needs '
          'the input batch shape. Pass '
          'model_registry.GetParams(name, "Train").task.')

  @classmethod
  def LayerStack(cls, task_params):
    """The flat layer stack and the input shapes of one training batch.

    Args:
      task_params: This task's params, with `input` set (e.g.
        `model_registry.GetParams(name, 'Train').task`).

    Returns:
      (list of layer params, tuple of tshape.Shape), the arguments the task
      gives `PartitionSequentialLayers`.
    """
    raise NotImplementedError(cls.__name__)

  def _PipelineParams(self):
    """The PipeliningLayer params; subclasses may adjust them."""
    p = self.params
    stack, shapes = self.LayerStack(p)
    cells = gpipe.PartitionSequentialLayers(
        stack, p.num_partitions, *shapes, cost=p.partition_cost)
    return gpipe.PipeliningLayer.Params().Set(
        name='pipeline', cell_tpl=cells,
        num_micro_batches=p.num_micro_batches,
        partition_independent_names=p.partition_independent_names,
        stack_variables=p.stack_variables,
        max_combined_variable_size=p.max_combined_variable_size)

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.stack_variables:
      for lp in self._LearnerParams():
        if lp.bprop_variable_filter or lp.bprop_variable_exclusion:
          raise ValueError(
              f'{p.name}: stack_variables=True with learner {lp.name!r} '
              'selecting variables by name (bprop_variable_filter / '
              'bprop_variable_exclusion): a stacked variable holds several '
              'layers\' variables under one name. Drop the filter or set '
              'task.stack_variables=False.')
    self.CreateChild('pipeline', self._PipelineParams())

  def _LearnerParams(self):
    tp = self.params.train
    learners = tp.learner if tp.learner else []
    return learners if isinstance(learners, (list, tuple)) else [learners]

  def BProp(self):
    super().BProp()
    if self.params.stack_variables:
      # The optimizer has made its slots: give them per-layer names too.
      stacking.StackSlotVariables()
