"""A Lingvo task whose layer stack runs as a GPipe pipeline."""

from lingvo.core import base_model

from lingvo_ext.core import gpipe


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
        partition_independent_names=p.partition_independent_names)

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('pipeline', self._PipelineParams())
