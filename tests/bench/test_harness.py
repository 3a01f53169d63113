"""bench/harness.py: the command-line tail every bench shares."""

import json

import pytest

from bench import harness


def testParserTakesTheDocstringsFirstLineAndMarkdown():
  parser = harness.Parser('One line.\n\nMore text.')
  assert parser.description == 'One line.'
  assert parser.parse_args(['--markdown']).markdown
  assert not parser.parse_args([]).markdown


def testCheckPositiveIsOneLineAndExit2(capsys):
  parser = harness.Parser('x')
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--M', type=int, nargs='+', default=[4])
  harness.CheckPositive(parser, parser.parse_args(['--M', '1', '2']),
                        ('steps', 'M'))
  for argv, bad in ((['--steps', '0'], '--steps must be >= 1, got 0.'),
                    (['--M', '4', '-1'], '--M must be >= 1, got -1.')):
    with pytest.raises(SystemExit) as e:
      harness.CheckPositive(parser, parser.parse_args(argv), ('steps', 'M'))
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(bad)


def testRoundRobinTakesTheStepsInTurnEachRound():
  calls = []
  times = harness.RoundRobin([lambda: calls.append('a'),
                              lambda: calls.append('b')], 3)
  assert calls == ['a', 'b'] * 3
  assert [len(t) for t in times] == [3, 3]
  assert all(s >= 0 for t in times for s in t)


def testTableAndEmit(capsys):
  table = harness.Table(('a', 'b'), [(1, 'x'), (2.5, 'y')])
  assert table.splitlines() == ['| a | b |', '|---|---|', '| 1 | x |',
                                '| 2.5 | y |']
  records = [dict(a=1), dict(a=2)]

  class Args:
    markdown = False

  harness.Emit(Args, records, lambda r: 'TABLE')
  assert [json.loads(l) for l in capsys.readouterr().out.splitlines()] == (
      records)
  Args.markdown = True
  harness.Emit(Args, records, lambda r: f'TABLE {len(r)}')
  assert capsys.readouterr().out == 'TABLE 2\n'


def testMachineNamesTheCpuItsCoresAndTheLoad():
  machine = harness.Machine()
  assert machine['cpu'] and machine['cores'] >= 1 and machine['load'] >= 0
