"""A sequence input's lengths against its buckets (tasks/sequence_checks.py),
on the GPipe NMT experiment's NmtInput tfrecords (tests/support/mt_testlib)."""

import re

import pytest

from lingvo_ext.preflight import dataset_checks
from lingvo_ext.tasks import experiment_params
from lingvo_ext.tasks import sequence_checks
from tests.support import mt_testlib

mt = pytest.fixture(scope='module', name='mt')(mt_testlib.Fixture)


def _Check(overrides, dataset='Train', model=mt_testlib.MODEL):
  cfg = experiment_params.GetParams(model, dataset, overrides)
  dataset_checks.Check(cfg, dataset)


def testTheSampleHasTheCorpusLengths(mt):
  del mt
  cfg = experiment_params.GetParams(mt_testlib.MODEL, 'Train')
  lengths = sequence_checks.SampleLengths(cfg.input.file_pattern)
  assert len(lengths) == mt_testlib.TRAIN_EXAMPLES
  # Source words + </s>; the target as long.
  assert (min(lengths), max(lengths)) == (mt_testlib.MIN_WORDS + 1,
                                          mt_testlib.MAX_WORDS + 1)
  assert len(sequence_checks.SampleLengths(cfg.input.file_pattern,
                                           records=7)) == 7
  assert sequence_checks.SampleLengths('text:/no/such') == []
  # Bounded in time: past the bound, no further record is read.
  assert len(sequence_checks.SampleLengths(cfg.input.file_pattern,
                                           seconds=0)) == 1


def testTheExperimentPassesSilently(mt, capsys):
  del mt
  sequence_checks._said.clear()  # pylint: disable=protected-access
  for dataset in ('Train', 'Dev', 'Test'):
    _Check('', dataset)
    _Check('', dataset, mt_testlib.BUCKETS_MODEL)
  assert capsys.readouterr().err == ''


def testNoExampleFitsIsOneLineNamingTheBound(mt):
  del mt
  with pytest.raises(ValueError) as e:
    _Check('input.bucket_upper_bound:[2];input.bucket_batch_limit:[8]')
  message = str(e.value)
  assert '\n' not in message
  assert message.startswith(
      'the Train input (input): input.bucket_upper_bound=[2]: none of the '
      f'{mt_testlib.TRAIN_EXAMPLES} examples sampled from input.file_pattern '
      f'fits (lengths 3..{mt_testlib.MAX_LENGTH}, the last bound 2)'), message
  assert f'Raise the last bound to {mt_testlib.MAX_LENGTH}' in message


def testABoundBeyondThePaddedLengthIsOneLineNamingBoth(mt):
  del mt
  with pytest.raises(ValueError) as e:
    _Check('input.bucket_upper_bound:[6, 8, 12];'
           'input.bucket_batch_limit:[8, 8, 8]')
  message = str(e.value)
  assert '\n' not in message
  assert ('input.bucket_upper_bound ends at 12, above '
          'input.source_max_length=10') in message
  assert 'Paddings must be non-negative' in message
  assert ('set input.source_max_length and input.target_max_length to 12, '
          'or the last bound to 10.') in message
  # Without pad_to_max_seq_length NmtInput pads to no max length.
  _Check('input.bucket_upper_bound:[6, 8, 12];'
         'input.bucket_batch_limit:[8, 6, 4]', model=mt_testlib.BUCKETS_MODEL)


def testDroppedExamplesAreCountedAndSaidOnce(mt, capsys):
  del mt
  sequence_checks._said.clear()  # pylint: disable=protected-access
  overrides = ('input.bucket_upper_bound:[6, 8];input.bucket_batch_limit:'
               '[8, 8];input.source_max_length:8;input.target_max_length:8')
  _Check(overrides)
  _Check(overrides)
  err = capsys.readouterr().err
  assert err.count('\n') == 1, err
  lengths = sequence_checks.SampleLengths(experiment_params.GetParams(
      mt_testlib.MODEL, 'Train').input.file_pattern)
  dropped = sum(1 for n in lengths if n > 8)
  assert dropped
  assert re.fullmatch(
      r'note: the Train input \(input\): %d of the %d examples sampled from '
      r'its files \(\d+%%\) are longer than input.bucket_upper_bound\'s last '
      r'bound 8 \(up to 10\): Lingvo\'s bucketing drops them.\n' % (
          dropped, len(lengths)), err), err
