"""The private TensorFlow symbols of lingvo_ext/_internal/tf.py, checked.

One test per symbol: after an upgrade, a failure names the symbol that moved
and the file that needs a change."""


import lingvo.compat as tf
import numpy as np

from lingvo_ext._internal import tf as internal_tf
from tests.support.internal_testlib import Check as _Check

# --- TensorFlow ---------------------------------------------------------------


def testControlFlowV2Switch():

  def Check():
    with tf.Graph().as_default():
      with internal_tf.V1ControlFlow():
        out = tf.cond(tf.constant(True), lambda: tf.constant(1),
                      lambda: tf.constant(2))
      assert out.op.type == 'Merge', out.op.type
      out = tf.cond(tf.constant(True), lambda: tf.constant(1),
                    lambda: tf.constant(2))
      assert out.op.type != 'Merge', out.op.type

  _Check('control_flow_util.ENABLE_CONTROL_FLOW_V2', Check)


def testMatMulGrad():

  def Check():
    with tf.Graph().as_default():
      a, b = tf.ones([2, 3]), tf.ones([3, 4])
      c = tf.matmul(a, b)
      ga, gb = internal_tf.MatMulGrad(c.op, tf.ones([2, 4]))
      with tf.Session() as sess:
        ga, gb = sess.run([ga, gb])
    np.testing.assert_allclose(ga, np.full([2, 3], 4.0))
    np.testing.assert_allclose(gb, np.full([3, 4], 2.0))

  _Check('math_grad._MatMulGrad', Check)


def testIsMklEnabled():
  _Check('_pywrap_util_port.IsMklEnabled',
         lambda: isinstance(internal_tf.IsMklEnabled(), bool) or 1 / 0)


def testSaveableObject():

  def Check():
    with tf.Graph().as_default():
      t = tf.constant([1.0])
      spec = internal_tf.SaveSpec(t, '', 'x')
      obj = internal_tf.SaveableObject(t, [spec], 'x')
      assert obj.specs[0].name == 'x'

  _Check('saveable_object.SaveableObject/SaveSpec', Check)


def testCheckpointState():

  def Check():
    state = internal_tf.CheckpointState(model_checkpoint_path='ckpt-1')
    assert state.model_checkpoint_path == 'ckpt-1'

  _Check('checkpoint_state_pb2.CheckpointState', Check)


def testSaveSliceInfo():

  def Check():
    with tf.Graph().as_default():
      whole = tf.get_variable('w', [4, 2], initializer=tf.zeros_initializer())
      parts = tf.get_variable(
          'p', [4, 2], initializer=tf.zeros_initializer(),
          partitioner=tf.compat.v1.fixed_size_partitioner(2))
      assert internal_tf.SaveSliceInfo(whole) is None
      shard = list(parts)[0]
      assert internal_tf.SaveSliceInfo(shard).full_shape == [4, 2]

  _Check('Variable._save_slice_info', Check)


def testOpIdAndAddControlInput():

  def Check():
    with tf.Graph().as_default():
      a, b = tf.no_op(name='a'), tf.no_op(name='b')
      assert internal_tf.OpId(a) < internal_tf.OpId(b)
      internal_tf.AddControlInput(a, b)
      assert a.control_inputs == [b]

  _Check('Operation._id/_add_control_input', Check)


def testBatchMatMulV2Grad():

  def Check():
    with tf.Graph().as_default():
      x = tf.constant(np.ones([2, 3, 4], np.float32))
      w = tf.constant(np.ones([4, 5], np.float32))
      y = tf.matmul(x, w)
      assert y.op.type == 'BatchMatMulV2'
      dx, dw = internal_tf.BatchMatMulV2Grad(y.op, tf.ones_like(y))
      assert dx.shape == x.shape and dw.shape == w.shape

  _Check('math_grad._BatchMatMulV2', Check)


def testUpdateInput():

  def Check():
    with tf.Graph().as_default():
      a, b = tf.constant(1.0), tf.constant(2.0)
      c = tf.identity(a)
      internal_tf.UpdateInput(c.op, 0, b)
      assert list(c.op.inputs) == [b]
      with tf.Session() as sess:
        assert sess.run(c) == 2.0

  _Check('Operation._update_input', Check)


def testFunctionGraph():

  def Check():
    import tensorflow as tf2  # pylint: disable=g-import-not-at-top
    with tf.Graph().as_default():
      x = tf.constant([1.0, 2.0])
      y = tf2.function(lambda a: tf.gather(a, [1]), autograph=False)(x)
      body = internal_tf.FunctionGraph(y.op)
      assert 'GatherV2' in [op.type for op in body.get_operations()]
      assert len(body.inputs) == 1
      assert internal_tf.FunctionGraph(x.op) is None

  _Check('Graph._get_function', Check)


def testOpGradients():

  def Check():
    import tensorflow as tf2  # pylint: disable=g-import-not-at-top
    with tf.Graph().as_default():
      x, w = tf.constant([[1.0, 2.0]]), tf.constant([[3.0], [4.0]])
      # A function call with a float output the loss does not use: its
      # gradient is zeros, as tf.gradients gives.
      f = tf2.function(lambda a, b: (tf.matmul(a, b), a * 2.0),
                       autograph=False)
      y, unused = f(x, w)
      assert y.op is unused.op
      dy = tf.constant([[5.0]])
      got = internal_tf.OpGradients(y.op, [dy, None])
      want = tf.gradients(y, [x, w], grad_ys=dy)
      assert len(got) == len(y.op.inputs)
      assert got[0].shape == x.shape and got[1].shape == w.shape
      with tf.Session() as sess:
        for a, b in zip(sess.run(got), sess.run(want)):
          np.testing.assert_allclose(a, b)

  _Check('ops.get_gradient_function', Check)


def _StableGraph(scale, name='cell', warm_up=0):
  """(function names, y, dy/dx) of a graph calling a jit tf.function named
  StableFunctionName(name) that scales its input, and its gradient; after
  `warm_up` other traced functions (they move TensorFlow's numbering)."""
  import tensorflow as tf2  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default() as g:
    for _ in range(warm_up):
      tf2.function(lambda a: a + 1.0, autograph=False)(tf.constant(1.0))

    def Scale(x):
      return x * scale

    Scale.__name__ = internal_tf.StableFunctionName(name)
    fn = tf2.function(Scale, autograph=False, jit_compile=True)
    x = tf.constant([1.0, 2.0])
    y = fn(x)
    dx = tf.gradients(tf.reduce_sum(y), x)[0]
    names = sorted(f.signature.name for f in g.as_graph_def().library.function
                   if 'lx_stable_' in f.signature.name)
    with tf.Session() as sess:
      return names, *sess.run([y, dx])


def testStableFunctionNames():

  def Check():
    before, y, dx = _StableGraph(2.0, 'stable_names_test')
    # The forward, its rewrite for the gradient and the backward function.
    assert len(before) == 3, before
    assert all(n.startswith(('__inference_', '__forward_')) for n in before)
    # Functions traced before do not rename them.
    after, y2, dx2 = _StableGraph(2.0, 'stable_names_test', warm_up=3)
    assert after == before, (after, before)
    np.testing.assert_allclose(y, [2.0, 4.0])
    np.testing.assert_allclose(y2, [2.0, 4.0])
    np.testing.assert_allclose(dx, [2.0, 2.0])
    # Another body under the same name: TensorFlow's numbering, no clash.
    other, y3, dx3 = _StableGraph(3.0, 'stable_names_test')
    assert other != before and len(other) == 3, other
    np.testing.assert_allclose(y3, [3.0, 6.0])
    np.testing.assert_allclose(dx3, [3.0, 3.0])

  _Check('concrete_function._inference_name, atomic_function.from_func_graph',
         Check)


def testCallsOptimizedOnce():

  def Check():
    import tensorflow as tf2  # pylint: disable=g-import-not-at-top
    f = tf2.function(lambda a: a * 2.0, autograph=False)
    with tf.Graph().as_default():
      x = tf.constant(1.0)
      with internal_tf.CallsOptimizedOnce():
        inside = f(x)
      outside = f(x)
      off = lambda t: tf.config_pb2.ConfigProto.FromString(t.op.get_attr(
          'config_proto')).graph_options.rewrite_options.disable_meta_optimizer
      assert off(inside) and not off(outside)
      with tf.Session() as sess:
        assert sess.run(inside) == 2.0

  _Check('eager context.function_call_options', Check)


def testLocalServerConfig():

  def Check():
    config = tf.compat.v1.ConfigProto()
    config.device_count['CPU'] = 3
    with internal_tf.LocalServerConfig(config):
      server = tf.distribute.Server.create_local_server()
    assert 'create_local_server' in vars(tf.distribute.Server)
    with tf.Session(server.target, config=config) as sess:
      cpus = [d for d in sess.list_devices() if d.device_type == 'CPU']
    assert len(cpus) == 3, cpus

  _Check('tf.distribute.Server.create_local_server', Check)


def testMakeCallable():

  def Check():
    with tf.Graph().as_default():
      v = tf.Variable(1.0)
      added = tf.identity(v.assign_add(1.0))
      doubled = tf.raw_ops.AssignAddVariableOp(resource=v.handle, value=v * 2)
      with tf.Session() as sess:
        sess.run(v.initializer)
        add = internal_tf.MakeCallable(sess, [added.name], [])
        assert [float(x) for x in add()] == [2.0]
        assert [float(x) for x in add()] == [3.0]
        assert internal_tf.MakeCallable(sess, [], [doubled.name])() == []
        assert sess.run(v) == 9.0

  _Check('Session._make_callable_from_options', Check)


def testFreezeSessionGraph():

  def Check():
    with tf.Graph().as_default() as g:
      v = tf.Variable([1.0, 2.0])
      ids = tf.placeholder(tf.int32, [None], name='ids')
      out = tf.while_loop(
          lambda i, x: i < 2, lambda i, x: (i + 1, x + v.read_value()),
          (0, tf.cast(ids, tf.float32)))[1]
      out = tf.identity(out, name='out')
      with tf.Session() as sess:
        sess.run(v.initializer)
        frozen = internal_tf.FreezeSessionGraph(sess, g.as_graph_def(),
                                                ['out'])
    assert not [n for n in frozen.node if n.op == 'VarHandleOp']
    with tf.Graph().as_default():
      tf.import_graph_def(frozen, name='')
      with tf.Session() as sess:
        np.testing.assert_allclose(sess.run('out:0', {'ids:0': [1, 0]}),
                                   [3.0, 4.0])

  _Check('convert_to_constants.convert_variables_to_constants_from_session_'
         'graph', Check)


def testSlurmClusterResolverModule():

  def Check():
    slurm = internal_tf.SlurmClusterResolverModule()
    assert slurm.expand_hostlist('n[1-2]') == ['n1', 'n2']
    assert slurm.expand_tasks_per_node('2(x2)') == [2, 2]
    assert slurm.SlurmClusterResolver

  _Check('slurm_cluster_resolver.expand_hostlist/expand_tasks_per_node', Check)


def testEagerModeExecutesEagerlyInAGraphModeProcess():
  # A fresh interpreter: eager execution off for the process, on inside.
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ('import tensorflow as tf\n'
          'tf.compat.v1.disable_eager_execution()\n'
          'from lingvo_ext._internal import tf as internal_tf\n'
          'assert not tf.executing_eagerly()\n'
          'with internal_tf.EagerMode():\n'
          '  assert tf.executing_eagerly()\n'
          '  assert float(tf.constant(2.0) * 3) == 6.0\n'
          'assert not tf.executing_eagerly()\n'
          'print("ok")\n')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0 and out.stdout == 'ok\n', out.stderr[-2000:]
