"""The tools on Lingvo's GPipe NMT experiment (tests/support/mt_testlib.py).

Its decoder's causal self-attention reads Lingvo's absl flag
--tflite_compatible while it builds: each tool parses absl's flags first
(entry_point.ParseFlags), as the trainer does.
"""

from absl import flags
import pytest

from lingvo_ext import entry_point
from lingvo_ext.tools import cost_report
from lingvo_ext.tools import plan as plan_tool
from tests.support import mt_testlib

mt = pytest.fixture(scope='module', name='mt')(mt_testlib.Fixture)


@pytest.fixture(name='unparsed')
def _Unparsed():
  """absl's flags as a fresh program has them: not parsed yet."""
  was = flags.FLAGS.is_parsed()
  flags.FLAGS.unparse_flags()
  yield
  if was and not flags.FLAGS.is_parsed():
    flags.FLAGS(['test'])


def testParseFlagsParsesOnceAndSaysABadFlag(unparsed):
  del unparsed
  assert entry_point.ParseFlags() is None
  assert flags.FLAGS.is_parsed() and flags.FLAGS.tflite_compatible is False
  error = entry_point.ParseFlags(['--tflite_compatible=maybe'])
  assert error and 'tflite_compatible' in error and '\n' not in error


def testPlanToolPlansTheMtStackWithFlagsUnparsed(mt, unparsed, capsys):
  del mt, unparsed
  rc = plan_tool.main([f'--model={mt_testlib.MODEL}', '--devices=2'])
  out = capsys.readouterr().out
  assert rc == 0, out[-3000:]
  assert 'plans for task.stack (GPipeTransformerStack, its 2 cells' in out
  assert '--num_cpu_devices=2 --worker_split_size=2' in out


def testCostReportReportsTheMtStacksCellsWithFlagsUnparsed(mt, unparsed,
                                                           capsys):
  del mt, unparsed
  rc = cost_report.main([f'--model={mt_testlib.MODEL}'])
  out, err = capsys.readouterr()
  assert rc == 0, err[-3000:]
  assert 'task.stack (GPipeTransformerStack): 2 cells' in out, out
  for cell in ('cell_0', 'cell_1'):
    assert cell in out
