"""lingvo_ext/_internal/deferred.py: the optional modules the trainer
defers load, and work, when used."""

import subprocess
import sys

import pytest

# --- Deferred optional imports (_internal/deferred.py) ---------------------------

_DEFERRED_USE = r'''
import sys
import lingvo_ext.trainer
from lingvo_ext._internal import deferred
loaded = sorted(m for m in ('sklearn.base', 'scipy.stats._stats_py',
                            'keras.src.wrappers') if m in sys.modules)
print('loaded at import:', loaded)
print('deferred:', sorted(n for n in deferred.DEFERRED
                          if type(sys.modules.get(n)) is deferred.Deferred))
# Used for real: the digits data, Lingvo's sklearn and scipy metrics, Keras's
# scikit-learn wrappers.
from lingvo_ext.tasks.image import input_generator
images, labels = input_generator.LoadImages('')
print('digits:', images.shape[0], int(labels.max()))
from lingvo.core import metrics
auc = metrics.AUCMetric()
auc.Update([1, 0, 1, 0, 1], [0.9, 0.2, 0.4, 0.6, 0.7])
import sklearn.metrics
want = sklearn.metrics.roc_auc_score([1, 0, 1, 0, 1], [0.9, 0.2, 0.4, 0.6, 0.7])
print('auc:', auc.value == want, want)
corr = metrics.CorrelationMetric(mode='spearman')
corr.Update([1., 2., 3., 4.], [1., 3., 2., 4.])
import scipy.stats
print('corr:', corr.value == scipy.stats.spearmanr([1, 2, 3, 4], [1, 3, 2, 4])[0])
import keras
from sklearn import base
print('keras:', issubclass(keras.wrappers.SKLearnClassifier, base.BaseEstimator))
'''


@pytest.mark.e2e
def testDeferredModulesLoadWhenUsed(tmp_path):
  """Importing the trainer defers scikit-learn; using it loads the real one."""
  import os  # pylint: disable=g-import-not-at-top

  from lingvo_ext._internal import deferred  # pylint: disable=g-import-not-at-top
  env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  out = subprocess.run([sys.executable, '-c', _DEFERRED_USE],
                       capture_output=True, text=True, cwd=str(tmp_path),
                       env=env, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = dict(l.split(': ', 1) for l in out.stdout.splitlines() if ': ' in l)
  assert lines['loaded at import'] == '[]', out.stdout
  assert lines['deferred'] == str(sorted(deferred.DEFERRED)), out.stdout
  assert lines['digits'] == '1797 9', out.stdout
  assert lines['auc'].startswith('True'), out.stdout
  assert lines['corr'] == 'True', out.stdout
  assert lines['keras'] == 'True', out.stdout


def testDeferredModuleBindsNowAndLoadsOnFirstUse(tmp_path, monkeypatch):
  """`import` binds the placeholder; an attribute or submodule loads it."""
  from lingvo_ext._internal import deferred  # pylint: disable=g-import-not-at-top
  pkg = tmp_path / 'deferred_pkg'
  pkg.mkdir()
  (pkg / '__init__.py').write_text('import sys\nsys.loads.append(__name__)\n'
                                   'X = 1\n')
  (pkg / 'sub.py').write_text('import sys\nsys.loads.append(__name__)\nY = 2\n')
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setattr(sys, 'loads', [], raising=False)
  monkeypatch.setattr(deferred, 'DEFERRED', ('deferred_pkg',
                                             'deferred_pkg.nope'))
  monkeypatch.setattr(deferred, '_TOO_LATE', ())
  try:
    # Only what is installed is deferred.
    assert deferred.Install() == ['deferred_pkg']
    import deferred_pkg  # pylint: disable=g-import-not-at-top,import-error
    assert sys.loads == [] and isinstance(deferred_pkg, deferred.Deferred)
    assert deferred_pkg.X == 1 and sys.loads == ['deferred_pkg']
    from deferred_pkg import sub  # pylint: disable=g-import-not-at-top,import-error
    assert sub.Y == 2 and sys.loads == ['deferred_pkg', 'deferred_pkg.sub']
    assert sys.modules['deferred_pkg'].sub is sub
    with pytest.raises(AttributeError):
      _ = deferred_pkg.nothing
    # A submodule's import loads its deferred package first.
    del sys.modules['deferred_pkg'], sys.modules['deferred_pkg.sub']
    sys.loads.clear()
    assert deferred.Install() == ['deferred_pkg']
    import deferred_pkg.sub  # pylint: disable=g-import-not-at-top,import-error,redefined-outer-name
    assert sys.loads == ['deferred_pkg', 'deferred_pkg.sub']
  finally:
    for name in ('deferred_pkg', 'deferred_pkg.sub'):
      sys.modules.pop(name, None)
