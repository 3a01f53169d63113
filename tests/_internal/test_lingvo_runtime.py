"""The Lingvo internals the runtime depends on (_internal/lingvo_runtime.py),
each checked against the installed Lingvo: an upgrade fails with a name."""


import pytest

from tests.support.internal_testlib import Check as _Check
from tests.support.internal_testlib import Gone as _Gone

# The Lingvo internals the runtime depends on (_internal/lingvo_runtime.py).


def _LingvoObject(dotted):
  """The class or method named `lingvo.module.Class[.method]`."""
  import importlib  # pylint: disable=g-import-not-at-top
  parts = dotted.split('.')
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module('.'.join(parts[:i]))
    except ImportError:
      continue
    for name in parts[i:]:
      obj = getattr(obj, name)
    return obj
  raise ImportError(dotted)


def _SelfNames(cls, store_only=False):
  """Names `self.<name>` in the source of cls and its bases of the same kind."""
  import ast  # pylint: disable=g-import-not-at-top
  import inspect  # pylint: disable=g-import-not-at-top
  import textwrap  # pylint: disable=g-import-not-at-top
  out = set()
  for c in (cls,) if store_only else cls.__mro__:
    if c is object:
      continue
    tree = ast.parse(textwrap.dedent(inspect.getsource(c)))
    out |= {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == 'self'
            and (not store_only or isinstance(n.ctx, ast.Store))}
  return out


@pytest.mark.parametrize('owner,name,signature',
                         __import__('lingvo_ext._internal.lingvo_runtime',
                                    fromlist=['x']).OVERRIDES)
def testOverriddenLingvoMethod(owner, name, signature):
  import inspect  # pylint: disable=g-import-not-at-top
  symbol = f'{owner}.{name}'
  _Check(symbol, lambda: _LingvoObject(symbol))
  got = str(inspect.signature(_LingvoObject(symbol)))
  assert got == signature, _Gone(symbol, ValueError(
      f'signature {got}, the runtime overrides {signature}'))


def testUsedLingvoNamesExist():
  from lingvo_ext._internal import lingvo_runtime  # pylint: disable=g-import-not-at-top
  for owner, names in lingvo_runtime.USES.items():
    cls = _LingvoObject(owner)
    attrs = _SelfNames(cls)
    for name in names:
      assert hasattr(cls, name) or name in attrs, _Gone(
          f'{owner}.{name}', AttributeError('not a method or self attribute'))


def testCopiedLingvoSourcesAreTheOnesCopied():
  import hashlib  # pylint: disable=g-import-not-at-top
  import inspect  # pylint: disable=g-import-not-at-top

  from lingvo_ext._internal import lingvo_runtime  # pylint: disable=g-import-not-at-top
  for symbol, digest in lingvo_runtime.COPIED.items():
    got = hashlib.sha256(
        inspect.getsource(_LingvoObject(symbol)).encode()).hexdigest()
    assert got == digest, _Gone(symbol, ValueError(
        'its source differs from the one the runtime copied (the comment '
        'in _internal/lingvo_runtime.py COPIED says where and what changed)'))


def testTheSharingControllerSetsWhatLingvosControllerInitSets():
  import ast  # pylint: disable=g-import-not-at-top,g-multiple-import
  import inspect
  import textwrap

  from lingvo import runners as lingvo_runners  # pylint: disable=g-import-not-at-top

  from lingvo_ext._internal import lingvo_runtime  # pylint: disable=g-import-not-at-top
  from lingvo_ext.runtime import one_build  # pylint: disable=g-import-not-at-top
  tree = ast.parse(textwrap.dedent(
      inspect.getsource(lingvo_runners.Controller.__init__)))
  lingvos = {n.attr for n in ast.walk(tree)
             if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
             and isinstance(n.value, ast.Name) and n.value.id == 'self'}
  assert sorted(lingvos) == sorted(lingvo_runtime.CONTROLLER_INIT_SETS), _Gone(
      'lingvo.runners.Controller.__init__', ValueError(
          f'sets {sorted(lingvos)}; one_build.py sets '
          f'{sorted(lingvo_runtime.CONTROLLER_INIT_SETS)}'))
  ours = _SelfNames(one_build.SharedModelControllerMixin, store_only=True)
  assert set(lingvo_runtime.CONTROLLER_INIT_SETS) <= ours, (
      sorted(set(lingvo_runtime.CONTROLLER_INIT_SETS) - ours))


def testLingvosTrainerFetchesTheStepTheTrainerSessionRecognises():
  import inspect  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top

  from lingvo_ext._internal import lingvo_runtime  # pylint: disable=g-import-not-at-top
  source = re.sub(r'\s+', '', inspect.getsource(
      _LingvoObject(lingvo_runtime.TRAIN_STEP_IN)))
  for fetch in lingvo_runtime.TRAIN_STEP_FETCHES:
    assert fetch in source, _Gone(lingvo_runtime.TRAIN_STEP_IN, ValueError(
        f'no longer runs {fetch}: local_trainer._TrainerSession recognises '
        'the training step by it'))


def testTheRuntimeUsesNoUnlistedLingvoInternal():
  """Every private Lingvo name the runners override or use is listed."""
  import inspect  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top

  from lingvo_ext._internal import lingvo_runtime  # pylint: disable=g-import-not-at-top
  from lingvo_ext.runtime import local_controller  # pylint: disable=g-import-not-at-top,g-multiple-import
  from lingvo_ext.runtime import local_evaler  # pylint: disable=g-import-not-at-top,g-multiple-import
  from lingvo_ext.runtime import local_trainer  # pylint: disable=g-import-not-at-top,g-multiple-import
  from lingvo_ext.runtime import runners  # pylint: disable=g-import-not-at-top,g-multiple-import
  overridden = {n for _, n, _ in lingvo_runtime.OVERRIDES}
  listed = overridden | {n for ns in lingvo_runtime.USES.values() for n in ns}
  unlisted = []
  for final in (runners.RunnerManager, local_controller.LocalController,
                local_trainer.LocalTrainer, local_evaler.LocalEvaler,
                local_evaler.LocalDecoder):
    lingvos = [c for c in final.__mro__ if c.__module__.startswith('lingvo.')]
    theirs = set().union(*(_SelfNames(c, store_only=True) for c in lingvos))
    for c in final.__mro__:
      if not c.__module__.startswith('lingvo_ext'):
        continue
      for name in vars(c):
        if (name.startswith('_') and not name.startswith('__') and
            any(hasattr(l, name) for l in lingvos) and name not in overridden):
          unlisted.append(f'{c.__name__}.{name} (override)')
      for name in set(re.findall(r'self\.(_[A-Za-z]\w*)',
                                 inspect.getsource(c))):
        if (name not in listed and name not in vars(c) and
            (name in theirs or any(hasattr(l, name) for l in lingvos))):
          unlisted.append(f'{c.__name__} uses {name}')
  assert not unlisted, (
      'Lingvo internals not in _internal/lingvo_runtime.py: ' +
      ', '.join(sorted(set(unlisted))))
