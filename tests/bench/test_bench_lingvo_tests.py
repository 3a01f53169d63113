"""bench/lingvo_tests.py: Lingvo's own test files run with lingvo_ext in."""

import os
import subprocess
import sys

import pytest

from tests.support import ROOT

HARNESS = os.path.join(ROOT, 'bench', 'lingvo_tests.py')

# A stand-in for one of Lingvo's test files: what it imports from
# lingvo.core must be lingvo_ext's, with the run's param defaults.
_TEST_FILE = '''
from absl.testing import absltest
from lingvo.core import gpipe
from lingvo.core import layers_with_gpipe
from lingvo.core.gpipe import PipeliningLayer


class SwapTest(absltest.TestCase):

  def testSwapped(self):
    self.assertEqual(gpipe.__name__, 'lingvo_ext.core.gpipe')
    self.assertEqual(layers_with_gpipe.__name__,
                     'lingvo_ext.core.layers_with_gpipe')
    p = PipeliningLayer.Params()
    self.assertEqual(p.schedule, WANT_SCHEDULE)
    self.assertEqual(p.recompute, WANT_RECOMPUTE)
    # The Transformer stack takes its defaults from PipeliningLayer's.
    self.assertEqual(
        layers_with_gpipe.GPipeTransformerStack.Params().schedule,
        WANT_SCHEDULE)


if __name__ == '__main__':
  absltest.main()
'''


def _Run(tmp_path, want, *args):
  path = tmp_path / 'swap_test.py'
  path.write_text(_TEST_FILE.replace('WANT_SCHEDULE', repr(want[0])).replace(
      'WANT_RECOMPUTE', repr(want[1])))
  out = subprocess.run(
      [sys.executable, HARNESS, *[a.replace('FILE', str(path)) for a in args]],
      capture_output=True, text=True, timeout=300, check=False,
      cwd=str(tmp_path))
  return out.returncode, out.stderr


@pytest.mark.e2e
def test_lingvo_test_file_runs_with_lingvo_ext_and_the_schedule(tmp_path):
  rc, err = _Run(tmp_path, ('zero_bubble', True), '--schedule', 'zero_bubble',
                 '--param', 'recompute=True', 'FILE')
  assert rc == 0, err[-3000:]
  # The file's own assertion fails when the defaults differ from its want.
  rc, err = _Run(tmp_path, ('1f1b', None), '--schedule', 'unrolled', 'FILE')
  assert rc == 1 and 'AssertionError' in err, err[-3000:]


@pytest.mark.e2e
@pytest.mark.parametrize('args,message', [
    (('--schedule', 'gpipe', 'FILE'), "--schedule='gpipe'; use one of"),
    (('--param', 'nope=1', 'FILE'), '--param nope: not a PipeliningLayer'),
    (('--param', 'recompute', 'FILE'), 'give NAME=VALUE'),
    (('missing_test.py',), 'no such file'),
])
def test_bad_arguments_are_one_line_errors(tmp_path, args, message):
  rc, err = _Run(tmp_path, ('unrolled', None), *args)
  assert rc == 2, err[-3000:]
  assert message in err, err
  assert 'Traceback' not in err
