"""XLA-compiled cells in the planner: predicted, calibrated, enumerated."""

import dataclasses

import pytest

from lingvo_ext import planner
from tests.support import planner_testlib as lib


def _Profile(flops, ops, num_layers=4, batch=32):
  layers = tuple(dataclasses.replace(lib.Layer('l%d' % i, flops=flops),
                                     fwd_ops=ops, bwd_ops=2 * ops)
                 for i in range(num_layers))
  return planner.ModelProfile(name='toy', layers=layers, batch=batch,
                              in_bytes=256.)


# Per-op time and a call of an XLA cell as the calibration finds them on the
# AVX2 EPYC (docs/benchmarks.md, "Planner"), XLA's GEMMs at 0.8x TF's rate.
_MACHINE = lib.Machine(flops_per_s=5e10, s_per_op=2e-5, cores=2,
                       xla_s_per_call=2e-4, xla_flop_factor=0.8)


def _Plan(profile, jit):
  return dataclasses.replace(lib.Plan(2, 4, profile=profile), jit_compile=jit)


def _Faster(profile):
  """The jit_compile the prediction takes for `profile`."""
  steps = {jit: planner.Predict(profile, _Plan(profile, jit), _MACHINE).step_s
           for jit in (False, True)}
  return min(steps, key=steps.get), steps


def test_many_small_ops_predict_xla_and_wide_gemms_predict_tensorflow():
  # A tiny Transformer's cell: hundreds of ops around few FLOPs.
  small, steps = _Faster(_Profile(flops=2e5, ops=150))
  assert small is True and steps[True] < 0.5 * steps[False]
  # A wide FC cell: a few ops around a large GEMM, which XLA runs slower.
  wide, steps = _Faster(_Profile(flops=2e8, ops=6))
  assert wide is False and steps[True] > 1.1 * steps[False]


def test_auto_is_the_faster_where_xla_is_calibrated_else_false():
  for profile in (_Profile(flops=2e5, ops=150), _Profile(flops=2e8, ops=6)):
    pred = {jit: planner.Predict(profile, _Plan(profile, jit), _MACHINE)
            for jit in (False, True, 'auto')}
    assert pred['auto'].step_s == min(pred[False].step_s, pred[True].step_s)
    uncalibrated = dataclasses.replace(_MACHINE, xla_s_per_call=None)
    assert planner.Predict(profile, _Plan(profile, 'auto'),
                           uncalibrated) == planner.Predict(
                               profile, _Plan(profile, False), uncalibrated)


def test_an_uncalibrated_call_costs_the_default_ops():
  machine = dataclasses.replace(_MACHINE, xla_s_per_call=None)
  assert machine.XlaSecondsPerCall() == pytest.approx(
      planner.model_profile.DEFAULT_XLA_OPS_PER_CALL * machine.s_per_op)


def _Refitted(profile, truth, refs):
  """CalibrateXla's machine from the references' steps under `truth`."""
  times = [planner.Predict(profile, p, truth).step_s for p in refs]
  probed = dataclasses.replace(_MACHINE, xla_s_per_call=None,
                               xla_flop_factor=1.)
  return planner.CalibrateXla(profile, probed, times)


@pytest.mark.parametrize('call,factor', [(2e-4, 0.8), (5e-5, 1.3),
                                         (1e-3, 0.5)])
@pytest.mark.parametrize('flops,ops', [(2e5, 150), (2e7, 20)])
def test_calibrate_xla_recovers_the_call_and_the_factor(call, factor, flops,
                                                        ops):
  profile = _Profile(flops=flops, ops=ops)
  truth = dataclasses.replace(_MACHINE, xla_s_per_call=call,
                              xla_flop_factor=factor)
  refs = planner.XlaReferencePlans(profile)
  assert [(p.num_cells, p.num_micro_batches, p.jit_compile)
          for p in refs] == [(1, 1, True), (1, 8, True)]
  fitted = _Refitted(profile, truth, refs)
  assert fitted.xla_s_per_call == pytest.approx(call, rel=1e-6)
  assert fitted.xla_flop_factor == pytest.approx(factor, rel=1e-6)
  assert fitted.xla_s_per_param_byte == 0.
  for p in refs:
    assert planner.Predict(profile, p, fitted).step_s == pytest.approx(
        planner.Predict(profile, p, truth).step_s)


@pytest.mark.parametrize('call,per_byte,factor', [
    (2e-4, 0., 0.8), (2e-5, 1e-8, 1.3), (0., 5e-8, 0.5), (1e-4, 2e-9, 2.)])
def test_calibrate_xla_tells_the_weights_cost_from_the_calls_on_two_cells(
    call, per_byte, factor):
  profile = _Profile(flops=2e6, ops=60)
  truth = dataclasses.replace(_MACHINE, xla_s_per_call=call,
                              xla_s_per_param_byte=per_byte,
                              xla_flop_factor=factor)
  refs = planner.XlaReferencePlans(profile, devices=2)
  assert [(p.num_cells, p.devices_per_replica, p.num_micro_batches)
          for p in refs] == [(1, 1, 1), (1, 1, 8), (2, 2, 8)]
  fitted = _Refitted(profile, truth, refs)
  assert fitted.xla_s_per_call == pytest.approx(call, abs=1e-9)
  assert fitted.xla_s_per_param_byte == pytest.approx(per_byte, abs=1e-14)
  assert fitted.xla_flop_factor == pytest.approx(factor, rel=1e-6)
  # Four cells on two devices at M=4: not a reference, predicted as true.
  other = dataclasses.replace(lib.Plan(4, 4, profile=profile, devices=2),
                              jit_compile=True)
  assert planner.Predict(profile, other, fitted).step_s == pytest.approx(
      planner.Predict(profile, other, truth).step_s)


def test_calibrate_xla_bounds_what_noise_cannot_explain():
  profile = _Profile(flops=2e5, ops=150)
  refs = planner.XlaReferencePlans(profile)
  truth = [planner.Predict(profile, p, _MACHINE).step_s for p in refs]
  lo, hi = planner.calibration.XLA_FLOP_FACTOR_RANGE
  # M=8 faster than its calls allow: no call time, the factor from M=1.
  fitted = planner.CalibrateXla(profile, _MACHINE, [truth[0], truth[0] / 20])
  assert fitted.xla_s_per_call >= 0.
  assert lo <= fitted.xla_flop_factor <= hi
  assert planner.Predict(profile, refs[0], fitted).step_s <= truth[0] * 1.0001
  # Steps far slower than the FLOPs: the factor at its lower bound, the rest
  # on the calls.
  fitted = planner.CalibrateXla(profile, _MACHINE, [100 * t for t in truth])
  assert lo <= fitted.xla_flop_factor <= hi and fitted.xla_s_per_call > 0


def test_enumerate_offers_xla_but_not_for_lingvos_loop():
  profile = _Profile(flops=2e5, ops=150)
  plans = planner.Enumerate(profile, 2, jit_choices=(False, True))
  loop = [p for p in plans if p.schedule == 'recurrent']
  assert loop and {p.jit_compile for p in loop} == {False}
  others = [p for p in plans if p.schedule == 'unrolled']
  assert {p.jit_compile for p in others} == {False, True}
  # Lingvo's loop predicted as it runs: its jit_compile changes nothing.
  p = dataclasses.replace(loop[0], jit_compile=True)
  assert not planner.Xla(p)
  assert planner.Predict(profile, p, _MACHINE) == planner.Predict(
      profile, loop[0], _MACHINE)
