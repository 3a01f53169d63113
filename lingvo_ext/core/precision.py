"""Mixed precision (bfloat16) for pipelined tasks: params, checks, bytes.

lingvo_ext trains in bfloat16 with Lingvo's own mixed precision: a layer's
`fprop_dtype=tf.bfloat16` casts its float32 variables to bfloat16 when it
reads them (`BaseLayer.theta`), so the cells compute in bfloat16, the
activations between cells and their gradients are bfloat16, and the
variables, their gradients (the gradient of the cast) and the optimizer stay
float32. Checkpoints hold the float32 variables, so they restore into a
float32 run and back. A task turns it on with `task.fprop_dtype`, e.g.
--model_params_override='task.fprop_dtype:bfloat16'.

On a CPU, TensorFlow's bfloat16 matmuls are fast only through oneDNN
(TF_ENABLE_ONEDNN_OPTS=1, TensorFlow's default on CPUs that have bfloat16
units); Eigen's bfloat16 kernels are slower than its float32 ones, and so
are oneDNN's on a CPU without bfloat16 units (bench/matmul.py tells which
case a CPU is; figures in docs/benchmarks.md).

The trainer calls `WarnIfSlow(task.fprop_dtype)` once for a PipelinedTask
experiment: it says when bfloat16 will be slow here. It also works round a TensorFlow 2.21 bug: with
oneDNN on, Grappler's remapper fuses a bfloat16 Conv2D + BiasAdd into
`_FusedConv2D`, which only oneDNN's rewrite can run, and a session over gRPC
(Lingvo's trainer, evaler and clusters) rejects the graph ("Value for attr
'T' of bfloat16 is not in the list of allowed values"). Where
`RemapperOff(task.fprop_dtype)`, the trainer's options say so
(`Options.grappler_remapping`) and every session config it makes has the
remapper off (`session_config.WithoutRemapper`).
"""

import sys

import lingvo.compat as tf

from lingvo_ext._internal import tf as internal_tf

# Values task.fprop_dtype takes from an override (text) or from Python.
_NAMES = {'float32': tf.float32, 'bfloat16': tf.bfloat16}
ENV_VAR = 'TF_ENABLE_ONEDNN_OPTS'
_warned = []


def ParseDtype(value, name='task.fprop_dtype'):
  """tf.float32, tf.bfloat16 or None (the layer's dtype) from `value`.

  Args:
    value: None, a tf.DType, or its name as an override gives it
      ('bfloat16', 'tf.bfloat16', quoted or not).
    name: The param, for the message.

  Returns:
    The tf.DType, or None.

  Raises:
    ValueError: any other value, naming the param and the values it takes.
  """
  if value is None:
    return None
  if isinstance(value, tf.DType):
    if value in _NAMES.values():
      return value
    text = value.name
  else:
    text = str(value).strip().strip('\'"')
    if text.startswith('tf.'):
      text = text[len('tf.'):]
    if text in _NAMES:
      return _NAMES[text]
  raise ValueError(
      f'{name}={text!r}; use bfloat16 (the cells compute in bfloat16, '
      'variables and updates stay float32), float32 or None, e.g. '
      f"--model_params_override='{name}:bfloat16'.")


def IsLowPrecision(dtype) -> bool:
  """Whether `dtype` (anything ParseDtype takes) computes in bfloat16."""
  return ParseDtype(dtype) == tf.bfloat16


def OneDnnEnabled() -> bool:
  """Whether TensorFlow runs its oneDNN CPU kernels in this process."""
  return internal_tf.IsMklEnabled()


# CPU feature flags of bfloat16 matmul units: x86's AVX512-BF16 and AMX-BF16,
# Arm's BF16 (in /proc/cpuinfo's 'flags' or 'Features' lines).
BF16_CPU_FLAGS = ('avx512_bf16', 'amx_bf16', 'bf16')


def CpuHasBf16Units(cpuinfo='/proc/cpuinfo'):
  """Whether the CPU has bfloat16 units; None where `cpuinfo` cannot tell."""
  try:
    with open(cpuinfo) as f:
      lines = f.read().splitlines()
  except OSError:
    return None
  flags = set()
  for line in lines:
    key, _, value = line.partition(':')
    if key.strip().lower() in ('flags', 'features'):
      flags.update(value.split())
  if not flags:
    return None
  return bool(flags.intersection(BF16_CPU_FLAGS))


def SlowBf16Warning(dtype, onednn=None, cpu_bf16=None):
  """The warning where bfloat16 is slow here, or None where it is not.

  Args:
    dtype: The task's fprop_dtype (anything ParseDtype takes).
    onednn: Whether oneDNN is on (default: this process's).
    cpu_bf16: Whether the CPU has bfloat16 units (default: CpuHasBf16Units;
      None, unknown, is taken as yes).
  """
  if not IsLowPrecision(dtype):
    return None
  if cpu_bf16 is None:
    cpu_bf16 = CpuHasBf16Units()
  if cpu_bf16 is False:
    return ('warning: task.fprop_dtype=bfloat16 on a CPU without bfloat16 '
            'units (no %s among its flags): bfloat16 matmuls are slower than '
            'float32 here, with oneDNN or without; train in float32 '
            "(--model_params_override='task.fprop_dtype:float32')."
            % '/'.join(BF16_CPU_FLAGS))
  if onednn is None:
    onednn = OneDnnEnabled()
  if onednn:
    return None
  return ('warning: task.fprop_dtype=bfloat16 with oneDNN off: TensorFlow\'s '
          'bfloat16 kernels without oneDNN are slower than float32 here; set '
          f'{ENV_VAR}=1 to turn oneDNN on (or train in float32).')


def WarnIfSlow(dtype):
  """Says once per process, one line on stderr, if bf16 will be slow here."""
  message = SlowBf16Warning(dtype)
  if message and not _warned:
    _warned.append(message)
    print(message, file=sys.stderr, flush=True)
  return message


def RemapperOff(dtype, onednn=None) -> bool:
  """Whether sessions computing in `dtype` need Grappler's remapper off
  (bfloat16 with oneDNN on: see the module docstring).

  Args:
    dtype: The task's fprop_dtype (anything ParseDtype takes).
    onednn: Whether oneDNN is on (default: this process's).
  """
  if not IsLowPrecision(dtype):
    return False
  return bool(OneDnnEnabled() if onednn is None else onednn)


def CrossDeviceTensors(graph, scalars=False):
  """{(tensor name, destination device): tf.Tensor} of floats between devices.

  Every floating-point tensor that an op placed on one device feeds to an op
  placed on another (both placed explicitly, as a pipeline's cells are):
  what TensorFlow sends between the cells' devices (processes, in a
  cluster), once per destination device, per step. Scalars (the micro-batch
  steps that seed random ops, in the pipeline's state_dtype) only with
  `scalars`. IdentityN ops are left out: the one that closes a pipeline
  (its custom gradient) takes every weight, but Grappler prunes its unused
  outputs, and nothing of them is sent (bench/cluster.py measures it).
  """
  out = {}
  for op in graph.get_operations():
    if not op.device or op.type == 'IdentityN':
      continue
    for t in op.inputs:
      if (t.dtype.is_floating and t.op.device and
          (scalars or t.shape.rank != 0) and
          tf.DeviceSpec.from_string(t.op.device) !=
          tf.DeviceSpec.from_string(op.device)):
        out[(t.name, op.device)] = t
  return out


def CrossDeviceBytes(graph, scalars=False):
  """(bytes, {dtype name: bytes}) of `CrossDeviceTensors` (static shapes)."""
  by_dtype = {}
  for t in CrossDeviceTensors(graph, scalars).values():
    n = t.shape.num_elements()
    if n is None:
      raise ValueError(f'{t.name} has no static shape {t.shape}; its bytes '
                       'are unknown.')
    by_dtype[t.dtype.name] = by_dtype.get(t.dtype.name, 0) + n * t.dtype.size
  return sum(by_dtype.values()), by_dtype
