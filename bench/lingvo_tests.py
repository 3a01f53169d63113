"""Runs one of Lingvo's own test files with lingvo_ext swapped in.

Lingvo's `lingvo/core/gpipe_test.py` and `layers_with_gpipe_test.py` do not
ship with the lingvo wheel; take them from a checkout of tensorflow/lingvo.
This harness makes `lingvo.core.gpipe` and `lingvo.core.layers_with_gpipe`
lingvo_ext's modules and sets the default of `PipeliningLayer`'s schedule
(and any other of its params) for the run, then runs the file as absltest
would; arguments after the file (test names) go to absltest.

  .venv/bin/python bench/lingvo_tests.py --schedule zero_bubble \\
      LINGVO_SRC/lingvo/core/gpipe_test.py
  .venv/bin/python bench/lingvo_tests.py --schedule unrolled \\
      --param recompute=True LINGVO_SRC/lingvo/core/layers_with_gpipe_test.py \\
      GPipeTransformerStackTest

A harness, not library code: it replaces the default of a param for the
whole process, which lingvo_ext itself never does.
"""

import argparse
import os
import runpy
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_VALUES = {'True': True, 'False': False, 'None': None}


def ParseArgs(argv):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--schedule', default='unrolled',
                      help="PipeliningLayer's default schedule for the run.")
  parser.add_argument('--param', action='append', default=[],
                      metavar='NAME=VALUE',
                      help='Another PipeliningLayer param default, e.g. '
                      'recompute=True or cell_functions=True (repeatable).')
  parser.add_argument('test_file', help="A Lingvo test file's path.")
  parser.add_argument('absltest_args', nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  params = {'schedule': args.schedule}
  for item in args.param:
    name, sep, value = item.partition('=')
    if not sep:
      parser.error('--param %r: give NAME=VALUE, e.g. recompute=True.' % item)
    params[name] = _VALUES.get(value, value)
  if not os.path.isfile(args.test_file):
    parser.error('test_file %r: no such file; give the path of a test file '
                 'of a tensorflow/lingvo checkout.' % args.test_file)
  return args, params


def main(argv=None):
  args, params = ParseArgs(sys.argv[1:] if argv is None else argv)
  sys.path.insert(0, _REPO)
  # pylint: disable=g-import-not-at-top
  import lingvo.core

  from lingvo_ext.core import gpipe
  from lingvo_ext.core import layers_with_gpipe
  from lingvo_ext.pipeline import schedules
  # pylint: enable=g-import-not-at-top
  if params['schedule'] not in schedules.SCHEDULES:
    print('error: --schedule=%r; use one of %s.' %
          (params['schedule'], sorted(schedules.SCHEDULES)), file=sys.stderr)
    return 2
  defaults = gpipe.PipeliningLayer.Params()
  unknown = sorted(set(params) - set(dict(defaults.IterParams())))
  if unknown:
    print('error: --param %s: not a PipeliningLayer param.' %
          ', '.join(unknown), file=sys.stderr)
    return 2
  make_params = gpipe.PipeliningLayer.Params.__func__

  def Params(cls):
    return make_params(cls).Set(**params)

  gpipe.PipeliningLayer.Params = classmethod(Params)
  sys.modules['lingvo.core.gpipe'] = gpipe
  sys.modules['lingvo.core.layers_with_gpipe'] = layers_with_gpipe
  lingvo.core.gpipe = gpipe
  lingvo.core.layers_with_gpipe = layers_with_gpipe
  sys.argv = [args.test_file] + args.absltest_args
  runpy.run_path(args.test_file, run_name='__main__')
  return 0


if __name__ == '__main__':
  sys.exit(main())
