"""The machine fitted to timed reference plans (calibration.py)."""

import dataclasses

import pytest

from lingvo_ext import planner
from tests.support import planner_testlib as lib


@pytest.mark.parametrize('cell_functions', [False, True])
def test_calibrate_recovers_the_constants(cell_functions):
  profile = dataclasses.replace(lib.Profile(linear_loss=False),
                                cell_functions=cell_functions)
  truth = planner.Machine(flops_per_s=6e8, s_per_op=3e-5, step_s=4e-3,
                          recurrent_op_factor=0.4, recurrent_s_per_byte=2e-9,
                          bytes_per_op=2048., overhead_bytes=5e8, cores=2,
                          s_per_reduced_var=9e-5)
  refs = planner.ReferencePlans(profile, devices=2)
  assert [(p.replicas, p.gradient_sync, p.global_batch) for p in refs] == [
      (1, 'shared', 32)] * 4 + [(2, 'all_reduce', 32), (1, 'shared', 16)]
  assert len(planner.ReferencePlans(profile, devices=1)) == 5
  times = [planner.Predict(profile, p, truth).step_s for p in refs]
  rss = [planner.Predict(profile, p, truth).process_bytes for p in refs]
  # The probe's FLOP rate is not the model's: the half batch fits it.
  probed = planner.Machine(flops_per_s=1e9, s_per_op=1e-6, cores=2)
  fitted = planner.Calibrate(profile, probed, times, rss)
  fields = ['flops_per_s', 's_per_op', 'step_s', 'recurrent_op_factor',
            'recurrent_s_per_byte', 's_per_reduced_var']
  if not cell_functions:  # The graph grows with M: its bytes per op fit.
    fields += ['bytes_per_op', 'overhead_bytes']
  for field in fields:
    assert getattr(fitted, field) == pytest.approx(getattr(truth, field)), (
        field)
  if cell_functions:
    # Cells built once: the references' graphs differ by a few calls, so
    # the bytes per op are the default, and the overhead makes the first
    # reference's predicted process peak its measured one.
    assert fitted.bytes_per_op == planner.DEFAULT_BYTES_PER_OP
    assert planner.Predict(profile, refs[0], fitted).process_bytes == (
        pytest.approx(rss[0]))
  # Without the fifth reference, all_reduce's time per variable stays
  # SYNC_OPS_PER_VAR ops.
  assert planner.Calibrate(profile, probed, times[:4]).s_per_reduced_var is None
  # Without the half batch, the probe's rate stays.
  assert planner.Calibrate(profile, probed, times[:5]).flops_per_s == 1e9


def test_calibrate_falls_back_when_more_steps_run_faster():
  """If 'recurrent' at the larger M runs faster than its one step allows
  (no cost per further step fits), the factor is fitted on the larger M
  alone, as with three references."""
  profile = lib.Profile(linear_loss=False)
  truth = planner.Machine(flops_per_s=1e9, s_per_op=3e-5, step_s=4e-3,
                          recurrent_op_factor=0.4, cores=2)
  refs = planner.ReferencePlans(profile)
  times = [planner.Predict(profile, p, truth).step_s for p in refs]
  probed = planner.Machine(flops_per_s=1e9, s_per_op=1e-6, cores=2)
  slow_one_step = times[:3] + [times[3] * 1.5]
  fitted = planner.Calibrate(profile, probed, slow_one_step)
  assert fitted.recurrent_s_per_byte == 0.
  assert fitted == planner.Calibrate(profile, probed, times[:3])
  assert fitted.recurrent_op_factor == pytest.approx(0.4)


@pytest.mark.parametrize('noise', [0.8, 0.9, 1.0])
def test_a_half_batch_step_off_by_noise_holds_the_fixed_time_at_zero(noise):
  # A step all FLOPs (a large batch): the half batch's step, a little off
  # half, would solve to a negative fixed time; held at 0, the rate fits.
  profile = lib.Profile(linear_loss=False, batch=64)
  truth = planner.Machine(flops_per_s=5e8, s_per_op=1e-6, step_s=0., cores=1)
  refs = planner.ReferencePlans(profile, devices=1)
  times = [planner.Predict(profile, p, truth).step_s for p in refs]
  times[-1] *= noise
  probed = planner.Machine(flops_per_s=2e9, s_per_op=1e-6, cores=1)
  fitted = planner.Calibrate(profile, probed, times, refs=refs)
  assert fitted.step_s >= 0
  assert fitted.flops_per_s == pytest.approx(5e8, rel=0.1)
  assert planner.Predict(profile, refs[0], fitted).step_s == pytest.approx(
      times[0], rel=0.1)
