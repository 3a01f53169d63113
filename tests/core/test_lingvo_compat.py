"""lingvo_ext.core.gpipe side by side with lingvo.core.gpipe.

Same params, built once with each library: the variable names (so checkpoint
keys) are equal, a checkpoint written by one restores into the other, and
with dropout on, the same seeds and the same global step, outputs (train and
eval) and gradients are equal, in every schedule (with dropout on, this
also shows that re-materialisation under '1f1b' draws the same masks).
"""

from absl import flags
import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import builder_layers
from lingvo.core import cluster_factory
from lingvo.core import gpipe as lingvo_gpipe
from lingvo.core import layers
from lingvo.core import layers_with_gpipe as lingvo_stacks
from lingvo.core import py_utils
import numpy as np
import pytest

from lingvo_ext.core import gpipe
from lingvo_ext.core import layers_with_gpipe as ext_stacks
from tests.support import gpipe_testlib as lib

# Lingvo's attention reads --tflite_compatible.
flags.FLAGS.mark_as_parsed()

B, D = 8, 6
GLOBAL_STEP = 3
# Every schedule of lingvo_ext's PipeliningLayer, and recompute.
SCHEDULES = [
    dict(schedule='unrolled'),
    dict(schedule='unrolled', recompute=True),
    dict(schedule='1f1b'),
    dict(schedule='recurrent'),
    dict(schedule='unrolled', cell_functions=False),
    dict(schedule='1f1b', cell_functions=False, recompute=True),
    dict(schedule='unrolled', jit_compile=True),
    dict(schedule='1f1b', jit_compile=True, recompute=True),
]
SCHEDULE_IDS = ['unrolled', 'unrolled-recompute', '1f1b', 'recurrent',
                'unrolled-inline', '1f1b-inline-recompute', 'unrolled-jit',
                '1f1b-jit-recompute']


class TupleOutLayer(base_layer.BaseLayer):
  """x -> (x,) or [x, 2x]: the structures whose return Lingvo normalises."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('as_list', False, 'Return [x, 2x] instead of (x,).')
    return p

  def FProp(self, theta, x, *unused):
    if self.params.as_list:
      return [x, x * 2.0]
    return (x,)

  @classmethod
  def FPropMeta(cls, p, x, *unused):
    shapes = (x, x) if p.as_list else (x,)
    return py_utils.NestedMap(flops=0, out_shapes=shapes)


def _Cell(mod, i, keep_prob=0.7, last=None):
  """Cell i: FC 'fc' then deterministic dropout 'drop', same names in all."""
  sub = [
      lib.Fc('fc', D, D, seed=10 + i),
      layers.DeterministicDropoutLayer.Params().Set(
          name='drop', keep_prob=keep_prob),
  ]
  if last is not None:
    sub.append(last)
  return mod.FeatureExtractionLayer.Params().Set(name='cell_%d' % i, sub=sub)


def _Cells(mod, num_cells=2, last=None):
  return [
      _Cell(mod, i, last=last if i == num_cells - 1 else None)
      for i in range(num_cells)
  ]


def _Build(mod, cells, num_devices=2, do_eval=False, with_grads=True,
           **kwargs):
  """Builds mod.PipeliningLayer in a new graph; returns graph and tensors."""
  g = tf.Graph()
  cluster = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=num_devices,
      split_size=num_devices, do_eval=do_eval)
  with g.as_default(), cluster:
    global_step = py_utils.GetOrCreateGlobalStepVar()
    with tf.variable_scope('model'):
      p = mod.PipeliningLayer.Params().Set(
          name='pipe', cell_tpl=cells, num_micro_batches=2, **kwargs)
      net = p.Instantiate()
      x = tf.constant(
          np.random.RandomState(0).uniform(-1, 1, [B, D]).astype(np.float32))
      out = net.FPropDefaultTheta(x)
    variables = net.vars.Flatten()
    grads = None
    if with_grads and not do_eval:
      grads = tf.gradients(
          lib._Loss(out), variables,  # pylint: disable=protected-access
          colocate_gradients_with_ops=True)
    t = py_utils.NestedMap(
        out=out, grads=grads, names=[v.op.name for v in variables],
        set_step=tf.assign(global_step, GLOBAL_STEP),
        init=tf.global_variables_initializer(),
        saver=tf.train.Saver())
  return g, t


def _Run(g, t, num_devices=2, restore=None, save=None):
  with lib.Session(g, num_devices) as sess:
    sess.run(t.init)
    if restore:
      t.saver.restore(sess, restore)
    sess.run(t.set_step)
    fetches = [t.out] + ([t.grads] if t.grads is not None else [])
    res = sess.run(fetches)
    if save:
      t.saver.save(sess, save)
  return res


# The quick tier compares each schedule with Lingvo; the recomputing
# variants (marked slow) run in the whole suite.
@pytest.mark.parametrize('schedule', [
    pytest.param(s, marks=pytest.mark.slow) if s.get('recompute') else s
    for s in SCHEDULES], ids=SCHEDULE_IDS)
def test_names_checkpoints_outputs_and_gradients_equal_lingvos(
    schedule, tmp_path):
  # Same-named sub-layers in different cells; dropout on; global step 3.
  lg, lt = _Build(lingvo_gpipe, _Cells(lingvo_gpipe))
  eg, et = _Build(gpipe, _Cells(gpipe), **schedule)
  assert et.names == lt.names
  assert 'model/cell_1/fc/w/var' in et.names, et.names

  # Lingvo -> lingvo_ext.
  lingvo_ckpt = str(tmp_path / 'lingvo')
  l_out, l_grads = _Run(lg, lt, save=lingvo_ckpt)
  e_out, e_grads = _Run(eg, et, restore=lingvo_ckpt)
  assert isinstance(e_out, np.ndarray)  # A bare tensor, as Lingvo's.
  # Lingvo's dropout masks, compiled with XLA (jit_compile) or not.
  np.testing.assert_array_equal(e_out == 0, l_out == 0)
  np.testing.assert_allclose(e_out, l_out, rtol=1e-5, atol=1e-6)
  for a, b in zip(e_grads, l_grads):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # Dropout is on: some, not all, activations are zeroed.
  assert 0 < np.mean(e_out == 0) < 0.8

  # lingvo_ext -> Lingvo, after changing the weights.
  with eg.as_default():
    bump = [tf.assign_add(v, 0.25 * tf.ones_like(v))
            for v in tf.global_variables()
            if 'fc/w' in v.op.name]
  ext_ckpt = str(tmp_path / 'ext')
  with lib.Session(eg, 2) as sess:
    sess.run(et.init)
    sess.run(bump)
    sess.run(et.set_step)
    e_out2 = sess.run(et.out)
    et.saver.save(sess, ext_ckpt)
  l_out2, _ = _Run(lg, lt, restore=ext_ckpt)
  assert not np.allclose(l_out2, l_out)
  np.testing.assert_allclose(e_out2, l_out2, rtol=1e-5, atol=1e-6)


def test_zbv_names_checkpoints_outputs_and_gradients_equal_lingvos(tmp_path):
  # 'zbv' places two cells on each device (in a V; Lingvo's loop round
  # robin): 4 cells on 2 devices, the same model.
  lg, lt = _Build(lingvo_gpipe, _Cells(lingvo_gpipe, 4))
  eg, et = _Build(gpipe, _Cells(gpipe, 4), schedule='zbv')
  assert et.names == lt.names
  ckpt = str(tmp_path / 'lingvo')
  l_out, l_grads = _Run(lg, lt, save=ckpt)
  e_out, e_grads = _Run(eg, et, restore=ckpt)
  np.testing.assert_allclose(e_out, l_out, rtol=1e-5, atol=1e-6)
  for a, b in zip(e_grads, l_grads):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert 0 < np.mean(e_out == 0) < 0.8


@pytest.mark.parametrize('num_devices', [1, 2])
def test_eval_outputs_equal_lingvos(num_devices, tmp_path):
  ckpt = str(tmp_path / 'ckpt')
  lg, lt = _Build(lingvo_gpipe, _Cells(lingvo_gpipe), num_devices, True)
  (l_out,) = _Run(lg, lt, num_devices, save=ckpt)
  for schedule in SCHEDULES:
    eg, et = _Build(gpipe, _Cells(gpipe), num_devices, True, **schedule)
    (e_out,) = _Run(eg, et, num_devices, restore=ckpt)
    np.testing.assert_allclose(e_out, l_out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('as_list', [False, True])
def test_output_structure_is_lingvos(as_list):
  last = TupleOutLayer.Params().Set(name='tuple', as_list=as_list)
  _, lt = _Build(lingvo_gpipe, _Cells(lingvo_gpipe, last=last),
                 with_grads=False)
  for schedule in SCHEDULES:
    _, et = _Build(gpipe, _Cells(gpipe, last=last), with_grads=False,
                   **schedule)
    assert type(et.out) is type(lt.out), schedule  # pylint: disable=unidiomatic-typecheck
    if as_list:
      assert isinstance(et.out, tuple) and len(et.out) == 2
    else:
      assert isinstance(et.out, tf.Tensor)


def test_sequential_layer_cells_keep_their_scope():
  # batch_major_attention.Builder makes cells like these; same sub names.
  def Cells():
    return [
        builder_layers.SequentialLayer.Params().Set(
            name='cell_%d' % i, sub=[lib.Fc('fc', D, D, seed=i)])
        for i in range(2)
    ]

  _, lt = _Build(lingvo_gpipe, Cells())
  _, et = _Build(gpipe, Cells())
  _, it = _Build(gpipe, Cells(), partition_independent_names=True)
  assert et.names == lt.names == it.names
  assert 'model/cell_1/fc/w/var' in et.names


def test_partition_independent_names_drop_the_cell_scope():
  def Cells():
    return [
        gpipe.FeatureExtractionLayer.Params().Set(
            name='d%d' % i, sub=[lib.Fc('fc%d' % i, D, D, seed=i)])
        for i in range(2)
    ]

  _, et = _Build(gpipe, Cells(), partition_independent_names=True)
  _, lt = _Build(lingvo_gpipe, Cells())
  assert et.names == ['model/fc0/b/var', 'model/fc0/w/var',
                      'model/fc1/b/var', 'model/fc1/w/var']
  assert lt.names == ['model/d0/fc0/b/var', 'model/d0/fc0/w/var',
                      'model/d1/fc1/b/var', 'model/d1/fc1/w/var']
  # Only there do same-named sub-layers collide.
  with pytest.raises(ValueError, match='partition_independent_names'):
    _Build(gpipe, _Cells(gpipe), partition_independent_names=True)


def _StackParams(stacks, schedule=None):
  """A tiny GPipeTransformerStack: 1 encoder, 1 decoder layer, 2 cells."""
  d = 4
  p = stacks.GPipeTransformerStack.Params().Set(
      name='transformer', model_dim=d, num_encoder_layers=1,
      num_decoder_layers=1, splits=2, num_micro_batches=2,
      state_dtype=tf.float32, random_seed=0)
  for t in (p.encoder_tpl, p.decoder_tpl):
    t.source_dim = d
    t.tr_atten_tpl.num_attention_heads = 1
    t.tr_fflayer_tpl.hidden_dim = d
    t.tr_atten_tpl.residual_dropout_prob = 0.1
    t.tr_fflayer_tpl.residual_dropout_prob = 0.1
  p.softmax_tpl.Set(input_dim=d, num_classes=3)
  p.emb_tpl.token_emb.Set(embedding_dim=d, vocab_size=10)
  p.emb_tpl.position_emb.embedding_dim = d
  p.emb_tpl.input_dropout_prob = 0.1
  if schedule:
    p.schedule = schedule
  return p


def _BuildStack(stacks, schedule=None):
  """The stack's training step on time-major ids; graph and tensors."""
  g = tf.Graph()
  with g.as_default(), lib.Cluster(2):
    global_step = py_utils.GetOrCreateGlobalStepVar()
    with tf.variable_scope('model'):
      net = _StackParams(stacks, schedule).Instantiate()
    rng = np.random.RandomState(0)
    t, b = 5, 4
    src = tf.constant(rng.randint(0, 10, [t, b]), tf.int32)
    tgt = tf.constant(rng.randint(0, 10, [t, b]), tf.int32)
    labels = tf.constant(rng.randint(0, 3, [t, b]), tf.int32)
    paddings = tf.zeros([t, b])
    xent, logits = net.FPropDefaultTheta(
        src, paddings, tgt, paddings, labels=labels,
        label_weights=tf.ones([t, b]))
    variables = net.vars.Flatten()
    grads = [
        tf.convert_to_tensor(x) for x in tf.gradients(
            tf.reduce_sum(xent), variables,
            colocate_gradients_with_ops=True)
    ]
    step = tf.placeholder(tf.int64, [])
    return g, py_utils.NestedMap(
        net=net, out=logits, grads=grads,
        names=[v.op.name for v in variables],
        init=tf.global_variables_initializer(), saver=tf.train.Saver(),
        step=step, set_step=tf.assign(global_step, step))


def _RunStack(g, t, restore=None, save=None, steps=(3,)):
  res = []
  with lib.Session(g, 2) as sess:
    sess.run(t.init)
    if restore:
      t.saver.restore(sess, restore)
    if save:
      t.saver.save(sess, save)
    for step in steps:
      sess.run(t.set_step, {t.step: step})
      res.append(sess.run([t.out, t.grads]))
  return res


def test_layers_with_gpipe_runs_on_lingvo_ext():
  assert issubclass(ext_stacks.GPipeTransformerStack, gpipe.PipeliningLayer)
  assert issubclass(ext_stacks.GPipeEvolvedTransformerStack,
                    gpipe.PipeliningLayer)
  assert issubclass(ext_stacks.GPipeBatchMajorTransformerStack,
                    gpipe.PipeliningLayer)
  # Lingvo's own module is untouched.
  assert lingvo_stacks.PipeliningLayer is lingvo_gpipe.PipeliningLayer


@pytest.mark.slow  # Two Transformer graphs; FC cells above in the quick tier.
def test_gpipe_transformer_stack_equals_lingvos(tmp_path):
  # Residual and input dropout on (deterministic, as the stack sets it up).
  # The default 'unrolled' schedule; 'recurrent' is Lingvo's own loop, and
  # both are compared with Lingvo on FC cells above. (A Transformer graph is
  # slow to build, so one schedule here.)
  lg, lt = _BuildStack(lingvo_stacks)
  eg, et = _BuildStack(ext_stacks)
  assert et.names == lt.names and len(et.names) == 43, et.names
  ckpt = str(tmp_path / 'lingvo')
  (l_out, l_grads), (l_out4, _) = _RunStack(lg, lt, save=ckpt, steps=(3, 4))
  assert not np.allclose(l_out, l_out4)  # Dropout follows the step.
  (e_out, e_grads), = _RunStack(eg, et, restore=ckpt)
  np.testing.assert_allclose(e_out, l_out, rtol=1e-5, atol=1e-5)
  for a, b in zip(e_grads, l_grads):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
