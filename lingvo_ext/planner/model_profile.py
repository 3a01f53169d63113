"""What the planner knows of a model and a machine (pure Python).

`ModelProfile`: a layer stack's per-layer forward FLOPs, op counts, parameter
bytes and kept activation bytes per example (`tf_profiling.ProfileExperiment`
measures them); `Machine`: the costs of compute on the devices planned for
(`tf_profiling.ProbeMachine` probes them, `calibration.Calibrate` fits them).
"""

import dataclasses
import math
from typing import Optional
from typing import Tuple

# Optimizer slots per parameter, by Lingvo optimizer class name.
OPTIMIZER_SLOTS = {'Adam': 2, 'AdamW': 2, 'Adagrad': 1, 'Momentum': 1,
                   'RMSProp': 2, 'SGD': 0, 'Adafactor': 1}
_SIZE_UNITS = {'': 1, 'B': 1, 'K': 2**10, 'KB': 2**10, 'KIB': 2**10,
               'M': 2**20, 'MB': 2**20, 'MIB': 2**20, 'G': 2**30,
               'GB': 2**30, 'GIB': 2**30, 'T': 2**40, 'TB': 2**40,
               'TIB': 2**40}


def ParseSize(text: str) -> int:
  """'512MB', '2G', '1.5GiB', '300000' -> bytes (units are powers of 1024).

  Raises:
    ValueError: not a number followed by one of B, K(B), M(B), G(B), T(B).
  """
  s = str(text).strip().upper().replace(' ', '')
  i = len(s)
  while i and not (s[i - 1].isdigit() or s[i - 1] == '.'):
    i -= 1
  number, unit = s[:i], s[i:]
  if unit not in _SIZE_UNITS or not number:
    raise ValueError('%r is not a size; write a number and a unit, e.g. '
                     '512MB, 2GB or 1.5GiB.' % (text,))
  try:
    value = float(number)
  except ValueError:
    raise ValueError('%r is not a size; write a number and a unit, e.g. '
                     '512MB, 2GB or 1.5GiB.' % (text,)) from None
  if value <= 0 or math.isinf(value):
    raise ValueError('%r must be a positive size, e.g. 512MB.' % (text,))
  return int(value * _SIZE_UNITS[unit])


def FormatSize(num_bytes: float) -> str:
  """Bytes as the largest unit that keeps a number >= 1 (1024-based)."""
  for unit, scale in (('GB', 2**30), ('MB', 2**20), ('KB', 2**10)):
    if abs(num_bytes) >= scale:
      return '%.1f%s' % (num_bytes / scale, unit)
  return '%dB' % num_bytes


@dataclasses.dataclass(frozen=True)
class LayerProfile:
  """What the planner knows of one layer of the stack.

  Attributes:
    name: The layer's name.
    flops: Forward FLOPs per example (FPropMeta).
    fwd_ops: Ops of its forward pass (independent of the batch).
    bwd_ops: Ops of its backward pass.
    param_bytes: Bytes of its variables.
    num_vars: Number of its variables.
    out_bytes: Bytes of its outputs per example (FPropMeta shapes).
    kept_bytes: Bytes its backward pass reads from the forward pass per
      example (the activations kept alive between them; at least out_bytes).
  """
  name: str
  flops: float
  fwd_ops: int
  bwd_ops: int
  param_bytes: int
  num_vars: int
  out_bytes: float
  kept_bytes: float


@dataclasses.dataclass(frozen=True)
class ModelProfile:
  """A layer stack as the planner sees it.

  Attributes:
    name: The experiment (or benchmark) name.
    layers: The stack's layers, in order.
    batch: The default global batch size.
    in_bytes: Bytes of the stack's input per example.
    optimizer_slots: Optimizer slot variables per parameter.
    linear_loss: Whether the loss is linear in the pipeline's outputs (per
      example losses summed in the last cell), which '1f1b' without
      recompute, 'interleaved_1f1b' and 'zero_bubble' need.
    loss_ops: Ops of the loss and its gradient outside the pipeline.
    cell_functions: Whether the pipeline builds each cell once, as a function
      called per micro-batch (PipeliningLayer.cell_functions, the default),
      rather than a copy per micro-batch (see GraphOps).
  """
  name: str
  layers: Tuple[LayerProfile, ...]
  batch: int
  in_bytes: float
  optimizer_slots: int = 2
  linear_loss: bool = False
  loss_ops: int = 20
  cell_functions: bool = True

  @property
  def param_bytes(self) -> int:
    return sum(l.param_bytes for l in self.layers)

  @property
  def num_vars(self) -> int:
    return sum(l.num_vars for l in self.layers)


# An uncalibrated XLA cell call costs this many ops' time (s_per_op):
# CalibrateXla fits about 95 on lm.TransformerLmTiny (75 us a call at 0.8 us
# an op), and more on the FC benchmark (docs/benchmarks.md, "Planner").
DEFAULT_XLA_OPS_PER_CALL = 100.


@dataclasses.dataclass(frozen=True)
class Machine:
  """The costs of compute on the devices planned for.

  Attributes:
    flops_per_s: FLOP rate of one device.
    s_per_op: Fixed time of one op (executor dispatch, kernel launch).
    bytes_per_s: Rate of moving bytes between devices (and of updates).
    cores: How many devices can compute at once (CPU devices of one host
      share its cores, and other processes' load takes its share); None: all
      of them. May be fractional. Where it is set, a device whose actions
      are not held to their lists (`GatedKinds`) runs several at once, up to
      the cores (TensorFlow's executor over the host's threads); else each
      device runs one action at a time.
    step_s: Fixed time of a training step (session run, input, summaries).
    update_ops_per_var: Ops of one variable's optimizer update.
    recurrent_op_factor: 'recurrent' only: the time of an op inside Lingvo's
      StackedRecurrent loop (a function the loop calls per micro-batch)
      over s_per_op.
    recurrent_s_per_byte: 'recurrent' only: seconds per byte of a cell's
      weights for each step of Lingvo's loop after its first (what the loop
      does with the weights and their gradients per step beyond the ops;
      none for one step).
    bytes_per_op: Process memory per op of the step's graph (graph,
      executor and kernel state, allocator slack).
    overhead_bytes: Process memory besides the model and its graph (TF
      runtime, input data); counted in the process total, not per device.
    s_per_handoff: Fixed time of one tensor handed from one device to
      another (a Send/Recv pair and its rendezvous), on top of its bytes over
      bytes_per_s: what a cell pays per micro-batch for its input (and its
      output's gradient) coming from a cell on another device.
    s_per_gate: Time an enforced action pays for its gate and
      completion (two NoOps and control edges that hold it behind the action
      before it on its device): the kinds of `actions.ORDERED_KINDS`, every
      action of 'interleaved_1f1b' and 'zero_bubble', the forward passes
      (and recomputations) of '1f1b'.
    add_bytes_per_s: Bytes per second an add of layer-sized tensors moves
      (two read, one written): the rate at which weight gradients are
      summed over micro-batches (`Accumulations`).
    s_per_reduced_var: Time per variable and replica that 'all_reduce'
      spends synchronising gradients beyond their bytes (a collective per
      variable and its rendezvous across the replicas' devices); None:
      SYNC_OPS_PER_VAR ops of s_per_op. Calibrate fits it.
    xla_s_per_call: Fixed time of one call of an XLA-compiled cell (a plan
      with jit_compile True): the launch of its executable, in place of the
      per-op time of the cell's ops, whose elementwise ones XLA fuses; None:
      DEFAULT_XLA_OPS_PER_CALL of s_per_op. CalibrateXla fits it.
    xla_flop_factor: XLA's FLOP rate in a compiled cell over flops_per_s
      (its own GEMM and convolution kernels, and its fused loops' memory
      traffic). CalibrateXla fits it.
    xla_s_per_param_byte: Time of one call of an XLA-compiled cell per byte
      of the cell's weights, whatever its micro-batch (what the compiled
      call does with its weights beyond the FLOPs). CalibrateXla fits it
      where it times a plan of two cells.
  """
  flops_per_s: float = 2e10
  s_per_op: float = 2e-5
  bytes_per_s: float = 5e9
  cores: Optional[float] = None
  step_s: float = 2e-3
  update_ops_per_var: int = 12
  recurrent_op_factor: float = 1.
  recurrent_s_per_byte: float = 0.
  bytes_per_op: float = 0.
  overhead_bytes: float = 0.
  s_per_handoff: float = 0.
  s_per_gate: float = 0.
  add_bytes_per_s: float = 5e10
  s_per_reduced_var: Optional[float] = None
  xla_s_per_call: Optional[float] = None
  xla_flop_factor: float = 1.
  xla_s_per_param_byte: float = 0.

  def XlaSecondsPerCall(self) -> float:
    if self.xla_s_per_call is not None:
      return self.xla_s_per_call
    return DEFAULT_XLA_OPS_PER_CALL * self.s_per_op

  def Parallel(self, devices: int) -> float:
    return devices if self.cores is None else max(1., min(devices, self.cores))
