"""The planner's command line (lingvo_ext/tools/plan.py)."""

import json
import os
import sys

import pytest

from lingvo_ext import planner
from tests.support import ROOT
from tests.support import host_copy
from tests.support import planner_testlib as lib
from tests.support import zygote


@pytest.mark.parametrize('flags,names', [
    (['--model=lm.NoSuchModel', '--devices=2'], '--model'),
    (['--model=%s' % lib.TINY, '--devices=0'], '--devices'),
    (['--model=%s' % lib.TINY, '--devices=2', '--memory_per_device=2XB'],
     '--memory_per_device'),
    (['--model=%s' % lib.TINY, '--devices=2', '--global_batch=0'],
     '--global_batch'),
    (['--model=%s' % lib.TINY, '--devices=2', '--measure_within=-0.1'],
     '--measure_within'),
    (['--model=%s' % lib.TINY, '--devices=2', '--measure', '--measure_steps=5'],
     '--measure_steps'),
])
def test_bad_flags_exit_2_with_one_line(flags, names, capsys):
  from lingvo_ext.tools import plan as plan_tool  # pylint: disable=g-import-not-at-top
  assert plan_tool.main(flags) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1, err
  assert err.startswith('error: ' + names), err


def test_budget_too_small_exits_2_naming_the_least(capsys):
  from lingvo_ext.tools import plan as plan_tool  # pylint: disable=g-import-not-at-top
  assert plan_tool.main(['--model=%s' % lib.TINY, '--devices=2',
                         '--memory_per_device=1KB', '--no-calibrate']) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1, err
  assert 'the smallest that fits one is' in err
  assert '--memory_per_device=' in err


@pytest.mark.e2e
def test_cli_json_parses_and_runs_the_best():
  env = dict(os.environ, PYTHONPATH=ROOT)
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.tools.plan', '--model=%s' % lib.TINY,
       '--devices=2', '--memory_per_device=64MB', '--json',
       '--no-calibrate'], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = json.loads(proc.stdout)
  assert out['plans'] and out['best'] == out['plans'][0]
  for p in out['plans']:
    assert p['devices'] <= 2
    assert p['peak_bytes'] <= 64 * 2**20
  assert out['model_params_override'] == planner.OverrideString(
      planner.PlanFromDict(out['best']))
  assert '--num_cpu_devices=%d' % out['best']['devices'] in out['command']
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.tools.plan', '--model=%s' % lib.TINY,
       '--devices=-1'], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=300, check=False)
  assert proc.returncode == 2
  assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.e2e
def test_cli_xla_plans_both_builds_with_xla_calibrated():
  env = dict(os.environ, PYTHONPATH=ROOT)
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.tools.plan', '--model=%s' % lib.TINY,
       '--devices=2', '--xla', '--json'], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = json.loads(proc.stdout)
  builds = {}
  for p in out['plans']:
    builds.setdefault(p['schedule'], set()).add(p['jit_compile'])
  assert builds.pop('recurrent') == {False}  # Lingvo's loop: no XLA build.
  assert builds and all(b == {False, True} for b in builds.values()), builds
  best = out['best']
  assert 'task.jit_compile:%s' % best['jit_compile'] in (
      out['model_params_override'])
  # The same plan predicted in both builds differs: XLA was calibrated.
  twins = {}
  for p in out['plans']:
    if p['schedule'] == 'unrolled':
      key = p['key'].rsplit(' ', 1)[0]
      twins.setdefault(key, {})[p['jit_compile']] = p['step_s']
  assert any(len(t) == 2 and t[True] != t[False] for t in twins.values())


@pytest.mark.e2e
def test_cli_xla_where_xla_cannot_compile_plans_without_it(tmp_path):
  (tmp_path / 'host_copy_exp.py').write_text(host_copy.EXPERIMENT)
  env = dict(os.environ, PYTHONPATH=str(tmp_path))
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.tools.plan',
       '--model=host_copy_exp.HostCopyTiny', '--devices=2', '--xla', '--json'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
      check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = json.loads(proc.stdout)
  assert out['plans'] and {p['jit_compile'] for p in out['plans']} == {False}
  assert 'task.jit_compile:False' in out['model_params_override']
  [warning] = [l for l in proc.stderr.splitlines()
               if 'XLA cannot compile the cells' in l]
  assert 'PyFunc' in warning and 'plans with XLA are not offered' in warning


def test_the_best_plans_peak_rss_is_the_memory_models(capsys, monkeypatch):
  from lingvo_ext.planner import memory_model  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import memory_probe  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tools import plan as plan_tool  # pylint: disable=g-import-not-at-top
  c = memory_model.Constants(runtime_bytes=800 * 2**20, activation_factor=1.2,
                             bytes_per_op=50e3)
  monkeypatch.setattr(memory_probe, 'Get', lambda n, force=False: c)
  assert plan_tool.main(['--model=%s' % lib.TINY, '--devices=2',
                         '--no-calibrate']) == 0
  out = capsys.readouterr().out.splitlines()
  best = out.index([l for l in out if l.startswith('best: ')][0])
  line = out[best + 1]
  assert line.startswith('its peak RSS (predicted): '), out
  # The line's total is the model's sum of terms, runtime first here.
  assert '(runtime 800.0MB' in line, line
