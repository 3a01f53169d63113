"""What an experiment's pipelines and other variables hold, cheaply (TF).

The start-up memory check of an experiment that is not a lingvo_ext
`PipelinedTask` (preflight/memory_check.py): Lingvo's own task code, e.g.
`GPipeTransformerLm`, holds its PipeliningLayers in its Params tree, already
cut into cells (tasks/pipeline_tree.py). The task is built once in a
throw-away graph on one CPU device, in eval mode: no session, no variable
initialised, no input read. As the task's forward pass runs each pipeline's
cells, their outputs are recorded; a time axis the task trims at run time is
sized by the input params' longest sequence. A cell gives its variables'
bytes, its outputs' and the activations it keeps: the tensors of its
forward ops that its gradient graph (built in the same throw-away graph,
never run) reads. The task's variables outside its pipelines (an embedding,
a softmax) are counted apart. No profiler runs, unlike the planner's
`tree.ProfileTree` for --plan=auto.

The memory model's graph term reads the nodes of the task's training graph
(`TrainingGraphNodes`: its forward and backward passes and its optimizer's
update, built on the run's devices in a process of its own, never run):
Lingvo's task code makes many more nodes per op computing on floats (small
functions of its own, per-variable bookkeeping) than the planner's op count
of its cells predicts.
"""

import dataclasses
import math
from typing import Optional
from typing import Tuple

from lingvo_ext.planner import tf_profiling
from lingvo_ext.planner import tree
from lingvo_ext.planner.model_profile import LayerProfile
from lingvo_ext.planner.model_profile import ModelProfile

# The most seconds TrainingGraphNodes' build may take.
_COUNT_TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True)
class TaskMemory:
  """What the estimate reads of a task.

  Attributes:
    pipes: Each pipeline (tree.TreePipeline), its cells' variables,
      outputs, kept activations per example and op counts; FLOPs are not
      read (0).
    params: Each pipeline's layer params, in the order of `pipes`.
    param_bytes: All the task's variables' bytes, pipelines' included.
    optimizer_slots: Slot variables per parameter of the task's optimizer.
    other_ops: The ops of the task's step outside its pipelines' cells
      (counted as tf_profiling.CountedOps): its forward ones, and as many
      backward ones per forward one as its cells have.
  """
  pipes: Tuple[tree.TreePipeline, ...]
  params: Tuple[object, ...]
  param_bytes: float
  optimizer_slots: int
  other_ops: float = 0.

  @property
  def other_param_bytes(self) -> float:
    """The bytes of the variables outside every pipeline."""
    return self.param_bytes - sum(p.profile.param_bytes for p in self.pipes)


def OtherTerms(mem: TaskMemory, bytes_per_op: float) -> dict:
  """{term: bytes} of a task's peak RSS outside its pipelines, which no plan
  of theirs changes: the other variables, their gradients and optimizer
  slots, and the graph of the other ops (memory_model.NODES_PER_OP nodes
  each)."""
  from lingvo_ext.planner import memory_model  # pylint: disable=g-import-not-at-top
  others = mem.other_param_bytes
  return dict(variables=others, gradients=others,
              optimizer_slots=others * mem.optimizer_slots,
              graph=memory_model.NODES_PER_OP * mem.other_ops * bytes_per_op)


def _Bytes(tensors, length: Optional[int], where: str) -> float:
  """The tensors' bytes, each dim known only at run time taken as `length`
  (Lingvo's LM tasks trim the time axis to the batch's longest sequence)."""
  total = 0.
  for t in tensors:
    if t is None or t.shape.rank is None:
      continue
    dims = t.shape.as_list()
    if None in dims and length is None:
      raise ValueError(f'{where}: a tensor of shape {t.shape} has dims known '
                       'only at run time and the input params name no max '
                       'length.')
    total += math.prod(length if d is None else d for d in dims) * t.dtype.size
  return total


def _RecordOutputs(layer, record):
  """Makes each cell of pipeline `layer` (this instance) record (its
  outputs, theta, inputs, its forward ops) in `record[cell name]` when the
  task runs it."""
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top

  def Record(name, fprop, theta, *args):
    g = tf.get_default_graph()
    n0 = len(g.get_operations())
    outs = fprop(theta, *args)
    record.setdefault(name, (outs, theta, args, g.get_operations()[n0:]))
    return outs

  layer.AddCellHook(Record)


def _KeptBytes(outs, theta, args, fwd, length: Optional[int],
               where: str) -> Tuple[float, int, int]:
  """(bytes of the tensors the cell's forward ops `fwd` make that its
  backward pass reads, its forward ops, its backward ops): tf.gradients
  built, never run; as tf_profiling's KeptBytes and CountedOps, dims known
  only at run time taken as `length`."""
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  floats = [o for o in tree.Tensors(outs) if o.dtype.is_floating]
  if not floats:
    return 0., tf_profiling.CountedOps(fwd), 0
  g = tf.get_default_graph()
  n1 = len(g.get_operations())
  loss = tf.add_n([tf.reduce_sum(o) for o in floats])
  xs = [t for t in tree.Tensors(theta) + tree.Tensors(args)
        if t.dtype.is_floating]
  tf.gradients(loss, xs)
  fwd_set = set(fwd)
  kept = {}
  bwd = g.get_operations()[n1:]
  for op in bwd:
    for t in op.inputs:
      t = tf_profiling.Source(t)
      if t.op in fwd_set:
        kept[t.name] = _Bytes([t], length, where)
  return (float(sum(kept.values())), tf_profiling.CountedOps(fwd),
          tf_profiling.CountedOps(bwd))


def ProfileTaskMemory(model_params, name: str = '',
                      length: Optional[int] = None) -> TaskMemory:
  """The TaskMemory of an experiment's params (TF; builds no session).

  Args:
    model_params: The experiment's params (overrides applied), with `task`
      and `input`.
    name: The experiment's name, for its profiles.
    length: The time axis to size for; None: the input params' longest
      sequence.

  Raises:
    ValueError: a pipeline of Lingvo's engine, or a time axis the input
      params do not bound (one line).
  """
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top

  from lingvo_ext.core import gpipe  # pylint: disable=g-import-not-at-top
  from lingvo_ext.pipeline import cost  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks import pipeline_tree  # pylint: disable=g-import-not-at-top
  pipelines = pipeline_tree.Pipelines(model_params.task)
  for path, p in pipelines:
    if not issubclass(p.cls, gpipe.PipeliningLayer):
      raise ValueError(f'task.{path} ({p.cls.__name__}) runs on Lingvo\'s '
                       'engine; the estimate reads lingvo_ext\'s.')
  task_p = model_params.task.Copy()
  task_p.input = model_params.input.Copy()
  tree.EvalSettingsForProfiling(task_p)
  cluster = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=1, split_size=1, do_eval=True)
  got, outputs = {}, {}
  pipes, params = [], []
  with cost.Sandbox(), cluster:
    py_utils.GetOrCreateGlobalStepVar()
    task = task_p.Instantiate()
    layers = tree.CapturePipelineInputs(task, pipelines, got)
    for path, layer in layers.items():
      _RecordOutputs(layer, outputs.setdefault(path, {}))
    if pipelines:
      task.FPropDefaultTheta()
    elif hasattr(task, 'InstantiateVariables'):
      task.InstantiateVariables()
    forward_ops = tf_profiling.CountedOps(
        tf.get_default_graph().get_operations())
    param_bytes = tree.TensorBytes(task.vars.Flatten())
    seq = length or tree.MaxLength(model_params.input)
    kept = {}
    for path, record in outputs.items():
      for cell_name, (outs, theta, args, fwd) in record.items():
        kept[path, cell_name] = _KeptBytes(outs, theta, args, fwd, seq,
                                           f'task.{path}')
  slots = tf_profiling.OptimizerSlots(task_p)
  for path, p in pipelines:
    if path not in got:
      continue  # Not run by the task's forward pass: holds no activation.
    where = f'task.{path}'
    args = tree.Tensors(got[path][1])
    batch = [t for t in args if t.shape.rank][0].shape.as_list()[p.batch_dim]
    if batch is None:
      raise ValueError(f'{where}: its batch size is known only at run time.')
    cells = []
    for name, cell in layers[path].Cells():
      variables = cell.vars.Flatten()
      out_bytes = _Bytes(tree.Tensors(outputs[path][name][0]), seq,
                         where) / batch
      held, fwd_ops, bwd_ops = kept.get((path, name), (0., 0, 0))
      cells.append(LayerProfile(
          name=name, flops=0., fwd_ops=fwd_ops, bwd_ops=bwd_ops,
          num_vars=len(variables),
          param_bytes=int(tree.TensorBytes(variables)), out_bytes=out_bytes,
          kept_bytes=max(held / batch, out_bytes)))
    floats = [t for t in args if t.dtype.is_floating]
    pipes.append(tree.TreePipeline(
        path='task.' + path, cls_name=p.cls.__name__,
        micro_batch_size=p.micro_batch_size,
        profile=ModelProfile(
            name=f'{name or task_p.name}:task.{path}', layers=tuple(cells),
            batch=int(batch), in_bytes=_Bytes(floats, seq, where) / batch,
            optimizer_slots=slots, linear_loss=False,
            cell_functions=bool(p.cell_functions))))
    params.append(p)
  cell_fwd = sum(v[1] for v in kept.values())
  cell_bwd = sum(v[2] for v in kept.values())
  other_fwd = max(forward_ops - cell_fwd, 0)
  return TaskMemory(pipes=tuple(pipes), params=tuple(params),
                    param_bytes=param_bytes, optimizer_slots=slots,
                    other_ops=other_fwd * (1. + cell_bwd / max(cell_fwd, 1)))


def BuiltNodes(graph) -> int:
  """The nodes of `graph`: its ops and the nodes of its functions' bodies
  (each instantiated, optimized and run by the runtime)."""
  library = graph.as_graph_def().library.function
  return len(graph.get_operations()) + sum(len(f.node_def) for f in library)


class NodeCount:
  """BuiltNodes of the experiment's training step (forward, backward, the
  optimizer's update) as built on `num_cpu_devices` CPU devices split by
  `split`: built in a throw-away graph, no session, nothing run (TF).

  The build runs in a process of its own, started here (`Result` waits for
  it): what TensorFlow and Lingvo keep of a training graph once built (some
  90 MB for the scaled-down flagship LM) would stay in this one and raise
  its peak RSS.
  """

  def __init__(self, model_params, num_cpu_devices: int = 1, split: int = 1):
    import os  # pylint: disable=g-import-not-at-top
    import pickle  # pylint: disable=g-import-not-at-top
    import subprocess  # pylint: disable=g-import-not-at-top
    import sys  # pylint: disable=g-import-not-at-top
    import tempfile  # pylint: disable=g-import-not-at-top
    self._dir = tempfile.TemporaryDirectory(prefix='lingvo_ext_nodes_')
    payload = os.path.join(self._dir.name, 'params.pickle')
    with open(payload, 'wb') as f:
      pickle.dump((list(sys.path), model_params, num_cpu_devices, split), f)
    self._err = open(os.path.join(self._dir.name, 'stderr.txt'), 'w+b')  # pylint: disable=consider-using-with
    code = ('from lingvo_ext import entry_point\n'
            'from lingvo_ext.planner import tree_memory\n'
            'tree_memory.CountMain()\n')
    self._proc = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, '-c', code, payload, str(os.getpid())],
        stdout=subprocess.PIPE, stderr=self._err)

  def Result(self) -> int:
    """The count.

    Raises:
      RuntimeError: the build failed or took more than _COUNT_TIMEOUT_S (its
        last line).
    """
    import subprocess  # pylint: disable=g-import-not-at-top
    try:
      out, _ = self._proc.communicate(timeout=_COUNT_TIMEOUT_S)
      if self._proc.returncode:
        self._err.seek(0)
        tail = (self._err.read().decode(errors='replace').strip()
                .splitlines() or ['no output'])[-1]
        raise RuntimeError(f'the training graph\'s build failed: {tail}')
    except subprocess.TimeoutExpired:
      raise RuntimeError('the training graph\'s build did not finish in '
                         f'{_COUNT_TIMEOUT_S} s') from None
    finally:
      self.Stop()
    return int(out.decode().split()[-1])

  def Stop(self) -> None:
    """Ends the build if it runs; removes its files."""
    if self._proc.poll() is None:
      self._proc.kill()
      self._proc.wait()
    self._err.close()
    self._dir.cleanup()


def TrainingGraphNodes(model_params, num_cpu_devices: int = 1,
                       split: int = 1) -> int:
  """NodeCount's result, waited for (RuntimeError as its)."""
  return NodeCount(model_params, num_cpu_devices, split).Result()


def ProfileWithNodes(model_params, num_cpu_devices: int = 1, split: int = 1
                     ) -> Tuple[TaskMemory, Optional[int]]:
  """(ProfileTaskMemory, the training graph's nodes or None where their
  build failed: a note in the log, the estimate then predicts them), the
  nodes counted meanwhile (NodeCount)."""
  from absl import logging  # pylint: disable=g-import-not-at-top
  count = NodeCount(model_params, num_cpu_devices, split)
  try:
    mem = ProfileTaskMemory(model_params)
  except BaseException:
    count.Stop()
    raise
  try:
    return mem, count.Result()
  except RuntimeError as e:
    logging.info('memory model: %s; predicting its nodes.', e)
    return mem, None


def CountMain() -> None:
  """NodeCount's process: reads (sys.path, params, devices, split) pickled
  in the file its first argument names, prints the count; ends with the
  process whose pid is its second argument (a build never outlives it)."""
  import pickle  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  from lingvo_ext.distributed import fork_serving  # pylint: disable=g-import-not-at-top
  fork_serving.DieWithParent(int(sys.argv[2]))()

  from absl import flags  # pylint: disable=g-import-not-at-top
  with open(sys.argv[1], 'rb') as f:
    path, model_params, devices, split = pickle.load(f)
  sys.path[:] = path
  if not flags.FLAGS.is_parsed():
    # Lingvo's task params (an MT model's) read absl flags when built.
    flags.FLAGS(sys.argv[:1], known_only=True)
  print(BuildAndCount(model_params, devices, split), flush=True)


def BuildAndCount(model_params, num_cpu_devices: int = 1,
                  split: int = 1) -> int:
  """TrainingGraphNodes, built in this process (TF)."""
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top

  from lingvo_ext.pipeline import cost  # pylint: disable=g-import-not-at-top
  task_p = model_params.task.Copy()
  task_p.input = model_params.input.Copy()
  cluster = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=num_cpu_devices,
      split_size=split)
  with cost.Sandbox() as g, cluster:
    py_utils.GetOrCreateGlobalStepVar()
    task = task_p.Instantiate()
    task.FPropDefaultTheta()
    task.BProp()
    return BuiltNodes(g)
