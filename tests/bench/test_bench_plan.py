"""bench/plan.py: the sweep and its re-prediction."""

import dataclasses
import json
import sys

import pytest

from lingvo_ext import planner
from tests.support import ROOT
from tests.support import planner_testlib as lib


def test_bench_sweep_takes_every_plan_the_planner_offers():
  sys.path.insert(0, ROOT)
  from bench import plan as bench_plan  # pylint: disable=g-import-not-at-top
  profile = lib.Profile(num_layers=6, batch=16)
  offered = [p.Key() for p in planner.Enumerate(profile, 2)]
  swept = bench_plan.SweepPlans(lib.TINY, profile, 2)
  assert [p.Key() for p in swept] == offered
  # The FC benchmark runs one replica; --micro_batches narrows the sweep.
  fc = bench_plan.SweepPlans(bench_plan.FC, profile, 2)
  assert [p.Key() for p in fc] == [
      p.Key() for p in planner.Enumerate(profile, 2) if p.replicas == 1]
  some = bench_plan.SweepPlans(lib.TINY, profile, 2, micro_batches=[1, 4])
  assert {p.num_micro_batches for p in some} == {1, 4}
  assert len(some) < len(offered)


def test_bench_repredict_gives_a_saved_run_the_same_predictions():
  # bench/plan.py --from_jsonl F --repredict: a run's own probe and reference
  # measurements, calibrated and predicted again, give back the run's
  # predictions when the planner is the same.
  sys.path.insert(0, ROOT)
  from bench import plan as bench_plan  # pylint: disable=g-import-not-at-top
  from bench import plan_report  # pylint: disable=g-import-not-at-top
  profile = bench_plan.Profile(bench_plan.FC)
  probe = planner.Machine(flops_per_s=1e10, s_per_op=2e-5, cores=2)
  truth = dataclasses.replace(probe, step_s=3e-3, overhead_bytes=7e8)
  refs = planner.ReferencePlans(profile)
  ref_s = [planner.Predict(profile, p, truth).step_s for p in refs]
  ref_rss = [planner.Predict(profile, p, truth).process_bytes
             for p in refs[:2]]
  machine = planner.Calibrate(profile, probe, ref_s, ref_rss, refs)
  plans = planner.PredictAll(
      profile, bench_plan.SweepPlans(bench_plan.FC, profile, 2), machine)
  plans = [p.Measured(step_s=p.step_s * (1. + 0.1 * (i % 3)),
                      rss_bytes=p.process_bytes * (1. + 0.01 * (i % 2)))
           for i, p in enumerate(plans)]
  record = json.loads(json.dumps(plan_report.Summary(
      bench_plan.FC, 2, plans, machine, {}, probe=dataclasses.asdict(probe),
      reference_keys=[p.Key() for p in refs],
      reference_ms=[1e3 * t for t in ref_s],
      reference_rss_mb=[r / 2**20 for r in ref_rss])))
  again = plan_report.Repredict(record, bench_plan.Profile,
                                bench_plan.ReferencePlans)
  for key in ('spearman', 'chosen_key', 'best_key', 'rows'):
    assert again[key] == record[key], key
  for key in ('mem_err_mean', 'mem_err_max'):  # Rows keep 0.1 MB.
    assert again[key] == pytest.approx(record[key], abs=1e-3), key
  assert 0 < record['mem_err_max'] <= 0.0101


def test_bench_repredict_reads_runs_before_the_reference_keys():
  # Runs without reference_keys timed 'unrolled' at the 'recurrent'
  # reference's M (4), not at 8: calibrated on those plans, not today's.
  sys.path.insert(0, ROOT)
  from bench import plan as bench_plan  # pylint: disable=g-import-not-at-top
  from bench import plan_report  # pylint: disable=g-import-not-at-top
  profile = bench_plan.Profile(bench_plan.FC)
  probe = planner.Machine(flops_per_s=1e10, s_per_op=2e-5, cores=2)
  truth = dataclasses.replace(probe, s_per_op=5e-5, step_s=3e-3)
  refs = planner.ReferencePlans(profile)
  assert [p.num_micro_batches for p in refs] == [1, 8, 4, 1, 1]
  old = [refs[0], dataclasses.replace(refs[1], num_micro_batches=4)] + refs[2:]
  ref_s = [planner.Predict(profile, p, truth).step_s for p in old]
  plans = planner.PredictAll(
      profile, bench_plan.SweepPlans(bench_plan.FC, profile, 2),
      planner.Calibrate(profile, probe, ref_s, refs=old))
  plans = [p.Measured(step_s=p.step_s, rss_bytes=p.process_bytes)
           for p in plans]
  record = json.loads(json.dumps(plan_report.Summary(
      bench_plan.FC, 2, plans, truth, {}, probe=dataclasses.asdict(probe),
      reference_ms=[1e3 * t for t in ref_s], reference_rss_mb=[])))
  again = plan_report.Repredict(record, bench_plan.Profile,
                                bench_plan.ReferencePlans)
  assert again['rows'] == record['rows']
  with pytest.raises(ValueError, match='references'):
    plan_report.Repredict(
        dict(record, reference_keys=[p.Key() for p in old]),
        bench_plan.Profile, bench_plan.ReferencePlans)


def test_bench_xla_calibrates_on_its_references_and_compares_each_pair(
    monkeypatch):
  # bench/plan.py --xla, its timings stood in for by a machine with known
  # XLA costs: the fit recovers them, and each plan's predicted XLA / no-XLA
  # ratio is the measured one.
  sys.path.insert(0, ROOT)
  from bench import plan as bench_plan  # pylint: disable=g-import-not-at-top
  from bench import plan_report  # pylint: disable=g-import-not-at-top
  probe = planner.Machine(flops_per_s=1e10, s_per_op=2e-5, cores=2)
  truth = dataclasses.replace(probe, step_s=3e-3, xla_s_per_call=4e-4,
                              xla_flop_factor=0.6, xla_s_per_param_byte=2e-12)
  profile = bench_plan.Profile(bench_plan.FC)
  timed = []

  def TimePlans(model, plans, rounds, warmup):
    del model, rounds, warmup
    timed.extend(plans)
    return [planner.Predict(profile, p, truth).step_s for p in plans]

  monkeypatch.setattr(bench_plan, 'TimePlans', TimePlans)
  monkeypatch.setattr(bench_plan.planner, 'ProbeMachine', lambda *a: probe)
  record = bench_plan.RunXla(bench_plan.FC, 2, rounds=1, warmup=0)
  # References first, then XLA's, then each plan without and with XLA.
  refs = planner.ReferencePlans(profile, devices=1)
  xla_refs = planner.XlaReferencePlans(profile, devices=2)
  assert [p.Key() for p in timed[:len(refs) + len(xla_refs)]] == [
      p.Key() for p in refs + xla_refs]
  assert [p.jit_compile for p in timed[len(refs) + len(xla_refs):]] == [
      False, True] * len(record['rows'])
  assert record['xla_flop_factor'] == pytest.approx(0.6, rel=1e-3)
  assert record['xla_s_per_call'] == pytest.approx(4e-4, rel=1e-3)
  assert len(record['rows']) == len(bench_plan.XLA_PLANS)
  for row in record['rows']:
    assert row['predicted_ratio'] == pytest.approx(row['measured_ratio'],
                                                   abs=2e-3), row
    assert row['agree'], row
  table = plan_report.XlaMarkdown([record])
  assert table.count('| %s |' % bench_plan.FC) == len(record['rows'])


def test_bench_pipelined_models_sweep_their_own_plans():
  sys.path.insert(0, ROOT)
  from bench import plan as bench_plan  # pylint: disable=g-import-not-at-top
  from bench import plan_models  # pylint: disable=g-import-not-at-top
  assert [plan_models.FcWidth(m) for m in ('fc', 'fc256', 'fc1024', 'lm.X',
                                           'lingvo_lm')] == [
                                               512, 256, 1024, None, None]
  assert {plan_models.FcWidth(m) for m in bench_plan.PIPELINED_MODELS} >= {
      256, 512, 1024}
  assert {plan_models.LINGVO_LM, plan_models.LINGVO_MT} <= set(
      bench_plan.PIPELINED_MODELS)
  # A pipeline that comes cut (2 cells): only its 2 cells, one replica,
  # where the sweep of a layer stack also cuts it into one cell and
  # replicates it.
  profile = lib.Profile(num_layers=2, batch=8)
  swept = plan_models.TreeSweep(profile, 2)
  assert swept and {(p.num_cells, p.replicas) for p in swept} == {(2, 1)}
  assert {(p.num_cells, p.replicas) for p in bench_plan.SweepPlans(
      lib.TINY, profile, 2)} == {(1, 1), (1, 2), (2, 1)}


def _Predicted(n):
  """bench/plan_report, a machine and the predictions of the first `n`
  plans of a 4-layer profile on 2 devices."""
  sys.path.insert(0, ROOT)
  from bench import plan_report  # pylint: disable=g-import-not-at-top
  profile = lib.Profile(num_layers=4, batch=8)
  machine = planner.Machine(flops_per_s=1e10, s_per_op=2e-5, cores=2)
  return plan_report, machine, planner.PredictAll(
      profile, planner.Enumerate(profile, 2)[:n], machine)


def test_bench_summary_reports_step_and_memory_errors():
  # Stand-in timings: each plan measured 0%, 10% or 20% above its
  # prediction; the memory model's RSS 5% under the measured.
  plan_report, machine, plans = _Predicted(6)
  plans = [p.Measured(step_s=p.step_s * (1. + 0.1 * (i % 3)),
                      rss_bytes=1e9) for i, p in enumerate(plans)]
  rss = {p.Key(): 0.95e9 for p in plans}
  record = plan_report.Summary('m', 2, plans, machine, {}, predicted_rss=rss)
  errors = sorted(abs(p.step_s - p.measured_step_s) / p.measured_step_s
                  for p in plans)
  assert record['step_err_max'] == pytest.approx(errors[-1], abs=1e-4)
  assert record['step_err_max'] == pytest.approx(0.2 / 1.2, abs=1e-4)
  assert record['step_err_mean'] == pytest.approx(
      sum(errors) / len(errors), abs=1e-4)
  assert record['mem_err_mean'] == record['mem_err_max'] == pytest.approx(
      0.05)
  assert record['chosen_over_best'] >= 1.
  table = plan_report.Markdown([record])
  assert '| step error mean / max |' in table
  assert '| %.1f%% / %.1f%% |' % (100 * record['step_err_mean'],
                                  100 * record['step_err_max']) in table


def test_bench_summary_checks_the_memory_model_on_the_sweeps_own_runtime():
  # The memory model's runtime term is a trainer's (1000 MB here); the
  # sweep's process runs on 700 MB: with that runtime in its place the
  # prediction is 2% high, where as it is it is 32% high.
  plan_report, machine, plans = _Predicted(5)
  mb = 2.**20
  plans = [p.Measured(step_s=p.step_s, rss_bytes=1000 * mb) for p in plans]
  rss = {p.Key(): 1320 * mb for p in plans}
  record = plan_report.Summary('m', 2, plans, machine, {}, predicted_rss=rss,
                               runtime_mb=1000., bench_runtime_mb=700.)
  assert record['mem_err_mean'] == record['mem_err_max'] == pytest.approx(
      0.32)
  assert record['mem_err_signed_mean'] == pytest.approx(0.32)
  assert record['mem_err_own_runtime_mean'] == pytest.approx(0.02)
  assert record['mem_err_own_runtime_max'] == pytest.approx(0.02)
  assert {row['predicted_rss_mb'] for row in record['rows']} == {1320.}
  # Without the sweep's runtime measured, no such column.
  bare = plan_report.Summary('m', 2, plans, machine, {}, predicted_rss=rss)
  assert 'mem_err_own_runtime_mean' not in bare
  table = plan_report.Markdown([record, bare])
  lines = table.split('\n')
  assert lines[0].count('|') == lines[1].count('|') == 13
  assert lines[2].count('|') == lines[3].count('|') == 13
  assert '| 32.0% / 32.0% (+32.0%) | 2.0% / 2.0% |' in lines[2]
  assert '| 32.0% / 32.0% (+32.0%) | - |' in lines[3]
  assert "runtime 1000 MB, the sweep's process's 700 MB" in table
  rows = [l for l in lines if l.startswith('| ' + plans[0].Key() + ' |')]
  assert len(rows) == 2 and all(l.count('|') == 9 for l in rows)
  assert '| 1320 | ' in rows[0]


def test_bench_measure_job_parses_flags_and_reads_the_runtimes_rss(
    tmp_path):
  # The fork server's children start with absl's flags unparsed, which the
  # encoder-decoder's layers read as they build: each job parses them, and
  # removes what a tree model wrote (plan_models.Cleanup).
  sys.path.insert(0, ROOT)
  from absl import flags  # pylint: disable=g-import-not-at-top

  from bench import plan as bench_plan  # pylint: disable=g-import-not-at-top
  from bench import plan_models  # pylint: disable=g-import-not-at-top
  written = tmp_path / 'tree'
  written.mkdir()
  plan_models._ROOTS.append(str(written))  # pylint: disable=protected-access
  got = bench_plan.MeasureJob(dict(model='fc256', devices=2, baseline=True))
  assert flags.FLAGS.is_parsed()
  assert not written.exists()
  assert set(got) == {'rss_bytes'} and got['rss_bytes'] > 2**20
  # A plan's job: the FC benchmark built under it, its steps timed.
  plan = bench_plan.SweepPlans('fc256', bench_plan.Profile('fc256'), 2,
                               micro_batches=[2])[0]
  got = bench_plan.MeasureJob(dict(model='fc256', plan=plan.ToDict(),
                                   steps=2, warmup=0))
  assert len(got['times']) == 2 and got['rss_bytes'] > 2**20


def test_bench_time_plans_builds_each_plan_once_across_timings(monkeypatch):
  # A Lingvo model's build takes up to a minute: the sweep's sessions are
  # timed again by the --measure and side-by-side timings, not rebuilt.
  sys.path.insert(0, ROOT)
  from bench import plan as bench_plan  # pylint: disable=g-import-not-at-top
  profile = lib.Profile(num_layers=4, batch=8)
  plans = planner.Enumerate(profile, 2)[:4]
  builds, closed = [], []

  class Session:

    def __init__(self, key):
      self.key = key

    def run(self, op):
      del op

    def close(self):
      closed.append(self.key)

  def BuildStep(model, plan):
    del model
    builds.append(plan.Key())
    return Session(plan.Key()), None

  monkeypatch.setattr(bench_plan, 'BuildStep', BuildStep)
  built = {}
  first = bench_plan.TimePlans('m', plans[:1] + plans, 2, 0, built=built)
  again = bench_plan.TimePlans('m', plans[2:], 3, 0, every_round=True,
                               built=built)
  assert len(first) == 5 and [len(t) for t in again] == [3, 3]
  assert builds == [p.Key() for p in plans] and not closed
  bench_plan.CloseAll(built.values())
  assert sorted(closed) == sorted(builds)
  # Without `built`: built and closed in the call.
  bench_plan.TimePlans('m', plans[:2], 1, 0)
  assert builds[4:] == closed[4:] == [p.Key() for p in plans[:2]]


def test_bench_tree_sweep_offers_recurrent_only_with_static_shapes(
    monkeypatch):
  # The flagship LM's input has its sequence length known only at run time:
  # its sweep has no 'recurrent' plan (which would refuse to build), as
  # tools.plan's has none.
  sys.path.insert(0, ROOT)
  from bench import plan as bench_plan  # pylint: disable=g-import-not-at-top
  from bench import plan_models  # pylint: disable=g-import-not-at-top
  from lingvo_ext.pipeline import records  # pylint: disable=g-import-not-at-top
  profile = lib.Profile(num_layers=2, batch=8)
  for length, recurrent in ((None, True), (16, False)):
    pipe = dataclasses.make_dataclass('Pipe', ['profile', 'length'])(
        profile, length)
    monkeypatch.setattr(plan_models, 'Tree',
                        lambda model, pipe=pipe: ('m', None, [pipe], 0, 0))
    swept = bench_plan.SweepPlans(plan_models.LINGVO_LM, profile, 2)
    assert swept and {(p.num_cells, p.replicas) for p in swept} == {(2, 1)}
    assert (records.LINGVO_ENGINE in {p.schedule for p in swept}) == (
        recurrent), length


def test_bench_summary_compares_the_fastest_plans_of_one_cell_and_of_more():
  sys.path.insert(0, ROOT)
  from bench import plan_report  # pylint: disable=g-import-not-at-top
  profile = lib.Profile(num_layers=4, batch=8)
  machine = planner.Machine(flops_per_s=1e10, s_per_op=2e-5, cores=2)
  plans = planner.PredictAll(profile, planner.Enumerate(profile, 2), machine)
  plans = [p.Measured(step_s=p.step_s, rss_bytes=1e9) for p in plans]
  one = [p.Key() for p in plans if p.num_cells == 1][:2]
  more = [p.Key() for p in plans if p.num_cells == 2][:2]
  side = {one[0]: 10., one[1]: 12., more[0]: 8., more[1]: 6.}
  record = plan_report.Summary('m', 2, plans, machine, {},
                               side_by_side_ms=side)
  assert record['side_one_cell_key'] == one[0]
  assert record['side_more_cells_key'] == more[1]
  assert record['side_more_over_one_cell'] == pytest.approx(0.6)
  assert '| 0.60 (%s / %s) |' % (more[1], one[0]) in plan_report.Markdown(
      [record])
  # Only plans of one cell timed: nothing to compare.
  alone = plan_report.Summary('m', 2, plans, machine, {},
                              side_by_side_ms={one[0]: 10.})
  assert 'side_more_over_one_cell' not in alone
