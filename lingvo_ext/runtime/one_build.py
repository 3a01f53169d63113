"""One build of the model per trainer process: the controller shares it.

Lingvo's Controller builds its own copy of the model, in its own graph, for
its saver and its train summaries, beside the Trainer's. Where both run in
one process (a local run: --job=controller,trainer_client, the default) the
two graphs name the same variables, which the process's one server holds, so
the second build only costs time. Here the controller takes the trainer's
graph and model instead (`SharedModelControllerMixin`):

- its checkpointer is built in that graph over the same variables: the same
  checkpoint keys and values, saved and restored as before;
- it does not run the model's merged train summaries itself (that run would
  take a batch of the trainer's input): at a summary step it asks for them
  (`TrainSummaries.Request`), the trainer's next step fetches them with its
  update, on its own batch, and the controller writes them to DIR/control;
- the trainer initialises the input and runs the enqueue ops, once.

Multi-process runs and multi-task models (whose merged summaries would run
every task) keep Lingvo's two builds. See docs/benchmarks.md ("Start-up").
"""

import os
import threading

from google.protobuf import text_format
from lingvo import runners as lingvo_runners
import lingvo.compat as tf
from lingvo.core import py_utils
from lingvo.core import summary_utils

FLAGS = tf.flags.FLAGS


class TrainSummaries:
  """The controller's train summaries, fetched with one of the trainer's steps.

  The controller `Connect`s its merged summary op and its writer and
  `Request`s a summary; the trainer's session takes the op with `Fetch` at
  its next training step and hands the result back with `Deliver`.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._op = None
    self._write = None
    self._wanted = False

  def Connect(self, op, write):
    """op: the summary op; write(summary_str, global_step) writes it."""
    with self._lock:
      self._op, self._write = op, write

  def Request(self):
    with self._lock:
      self._wanted = self._op is not None

  def Fetch(self):
    """The op to fetch with this training step, or None."""
    with self._lock:
      if not self._wanted:
        return None
      self._wanted = False
      return self._op

  def Deliver(self, summary_str, global_step):
    self._write(summary_str, global_step)


def CanShare(model):
  """Whether a controller can share `model` (a trainer's built model)."""
  return len(model.tasks) == 1 and not py_utils.IsEagerMode()


class SharedModelControllerMixin:
  """Lingvo's Controller.__init__ on an in-process trainer's graph and model.

  Goes right before lingvo.runners.Controller in a controller's bases and
  takes `trainer` (keyword): a Trainer already built in this process, with
  `graph` and `model` properties, or None for Lingvo's own build. The runner
  needs `self._run_state.train_summaries` (a TrainSummaries).
  """

  def __init__(self, *args, trainer=None, **kwargs):
    self._shared_with = trainer
    if trainer is None:
      super().__init__(*args, **kwargs)
      return
    # BaseRunner's set-up (params, cluster, devices), not Controller's build;
    # what that sets is _internal/lingvo_runtime.py CONTROLLER_INIT_SETS.
    super(lingvo_runners.Controller, self).__init__(*args, **kwargs)
    self._job_name = 'controller'
    assert not self._model_task_name, 'Controller needs all tasks!'
    self._control_dir = os.path.join(self._logdir, 'control')
    tf.io.gfile.makedirs(self._control_dir)
    # As Lingvo's Controller: a trainer that checkpoints itself.
    self._checkpoint_in_controller = not (FLAGS.checkpoint_in_trainer_tpu or
                                          FLAGS.checkpoint_in_trainer_cpu)
    self._graph, self._model = trainer.graph, trainer.model
    own = self.params  # The controller's, from BaseRunner.
    self._params = self._model.params.Copy()
    self._params.cluster = own.cluster  # Its params.txt says 'controller'.
    with self._graph.as_default(), tf.container(self._container_id):
      with self._cluster, tf.device(self._cluster.GetPlacer()):
        self._global_step_var = py_utils.GetOrCreateGlobalStepVar()
        self._summary_writer = self._CreateSummaryWriter(self._control_dir)
        self._summary_op = tf.summary.merge_all()
        if self._checkpoint_in_controller:
          self._checkpointer = self._CreateCheckpointer(self._train_dir,
                                                        self._model)
        self._initialize_tables = tf.tables_initializer()
        self._initialize_local_vars = tf.local_variables_initializer()
        self._initialize_global_vars = tf.global_variables_initializer()
        self.enqueue_ops = []  # The trainer runs the model's.
    self._run_state.train_summaries.Connect(self._summary_op,
                                            self._WriteTrainSummary)
    # The rest is Lingvo's Controller.__init__ as it is, but for the files
    # WriteRunFiles writes.
    self._ExportMetrics(params=self.params)
    self._total_num_params = None
    self._run_files_written = False

  def WriteRunFiles(self):
    """Writes what Lingvo's Controller.__init__ writes: analysis, params, graph.

    The sharing controller writes them from its loop once the trainer may
    step (the model's analysis and the graph's serialization then run beside
    the first step, not before it); a no-op otherwise or when done.
    """
    if not self.shares_model or self._run_files_written:
      return
    self._run_files_written = True
    self._model_analysis, self._total_num_params = summary_utils.ModelAnalysis(
        self._model, FLAGS.inspect_model_topn, FLAGS.inspect_model_part_regex)
    py_utils.LogMultiLines('MODEL ANALYSIS', self._model_analysis)
    self._WriteToLog(self._model_analysis, self._control_dir,
                     'model_analysis.txt')
    self._WriteToLog(self.params.ToText(), self._control_dir, 'params.txt')
    self._WriteToLog(
        text_format.MessageToString(self.params.ToProto(), as_utf8=True),
        self._control_dir, 'params.pbtxt')
    self._summary_writer.add_graph(self._graph)

  @property
  def shares_model(self):
    """Whether this controller uses the in-process trainer's model."""
    return self._shared_with is not None

  def _WriteTrainSummary(self, summary_str, global_step):
    """Lingvo's controller's summary write, for a summary the trainer ran."""
    self._summary_writer.add_summary(summary_str, global_step)
    tf.logging.info('Write summary @%s', global_step)
    self._SummarizeValue(global_step, 'total_num_params',
                         self._total_num_params)
