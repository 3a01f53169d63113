"""Lingvo's own GPipe models on lingvo_ext's engine: a rewrite of their params.

Most Lingvo GPipe models do not import `lingvo.core.gpipe` themselves: the
pipeline is built by Lingvo's own code, e.g.
`lingvo.tasks.lm.layers.GPipeTransformerLm` (its `stack` param holds a
`lingvo.core.layers_with_gpipe.GPipeBatchMajorTransformerStack`) or
`batch_major_attention.Builder` with `num_splits`/`num_micro_batches` (its
`_MaybeSplit` puts `lingvo.core.gpipe.PipeliningLayer` params into the stack
it returns). All of them leave the pipeline in the experiment's Params tree
before anything is instantiated: Lingvo's layers only instantiate the params
they hold (`CreateChild(name, p.stack)`). So `FromLingvo(params)` walks the
tree and gives each of those layers' params lingvo_ext's class instead:

  lingvo.core.gpipe.{PipeliningLayer, SeqLayer, FeatureExtractionLayer}
    -> lingvo_ext.core.gpipe's classes of the same name;
  lingvo.core.layers_with_gpipe.X -> lingvo_ext.core.layers_with_gpipe.X
    (Lingvo's own module run on lingvo_ext's engine).

Each is lingvo_ext's `Params()` carrying every value of Lingvo's (lingvo_ext
defines all of Lingvo's params with the same meaning); lingvo_ext's own
params keep their defaults, which give Lingvo's variable names, so
checkpoints move between the two engines unchanged. Nothing of Lingvo is
patched: an experiment that is not rewritten runs on Lingvo's engine.

  from lingvo_ext.core import from_lingvo
  params = from_lingvo.FromLingvo(model_registry.GetParams('my.LmExperiment', 'Train'))

The trainer does this for every experiment (`--gpipe_engine=lingvo_ext`, the
default; `--gpipe_engine=lingvo` leaves the params as they are). See
docs/coming-from-lingvo.md.
"""

import copy

from lingvo.core import gpipe as lingvo_gpipe
from lingvo.core import hyperparams
from lingvo.core import layers_with_gpipe as lingvo_layers_with_gpipe

from lingvo_ext.core import gpipe as ext_gpipe
from lingvo_ext.core import layers_with_gpipe as ext_layers_with_gpipe

ENGINES = ('lingvo_ext', 'lingvo')

_CLASS_MAP = {}


def _ClassMap():
  """{Lingvo's GPipe class: lingvo_ext's class of the same name}."""
  if _CLASS_MAP:
    return _CLASS_MAP
  mapping = _CLASS_MAP
  for name in ('PipeliningLayer', 'SeqLayer', 'FeatureExtractionLayer'):
    mapping[getattr(lingvo_gpipe, name)] = getattr(ext_gpipe, name)
  for name, value in vars(lingvo_layers_with_gpipe).items():
    if (isinstance(value, type) and
        value.__module__ == lingvo_layers_with_gpipe.__name__):
      mapping[value] = getattr(ext_layers_with_gpipe, name)
  return mapping


def LingvoClasses():
  """The Lingvo classes FromLingvo replaces, with lingvo_ext's for each."""
  return dict(_ClassMap())


def _Rewrite(value, count):
  """`value`, or what replaces it: Lingvo GPipe layers' params made
  lingvo_ext's. Containers are rewritten in place (FromLingvo copies first).
  """
  if isinstance(value, hyperparams.Params):
    ext_cls = (_ClassMap().get(value.cls) if
               isinstance(value, hyperparams.InstantiableParams) else None)
    if ext_cls is None:
      for name, sub in value.IterParams():
        new = _Rewrite(sub, count)
        if new is not sub:
          value.Set(**{name: new})
      return value
    out = ext_cls.Params()
    for name, sub in value.IterParams():
      if name == 'cls':
        continue
      if name not in out:
        raise ValueError(
            f'FromLingvo: {value.cls.__name__} param {name!r} (of '
            f'{value.name!r}) has no counterpart in lingvo_ext\'s '
            f'{ext_cls.__name__}; run this model with --gpipe_engine=lingvo.')
      out.Set(**{name: _Rewrite(sub, count)})
    count[0] += 1
    return out
  if isinstance(value, dict):  # NestedMap too.
    for k, v in list(value.items()):
      new = _Rewrite(v, count)
      if new is not v:
        value[k] = new
    return value
  if isinstance(value, list):
    for i, v in enumerate(value):
      value[i] = _Rewrite(v, count)
    return value
  if isinstance(value, tuple) and not hasattr(value, '_fields'):
    items = tuple(_Rewrite(v, count) for v in value)
    return value if all(a is b for a, b in zip(items, value)) else items
  return value


def FromLingvo(params):
  """A copy of `params` with every Lingvo GPipe layer on lingvo_ext's engine.

  Args:
    params: Any Lingvo params (an experiment's model params, a task's, a
      layer's), or a list/NestedMap of them; not modified.

  Returns:
    The rewritten copy: the same tree, where each `lingvo.core.gpipe` or
    `lingvo.core.layers_with_gpipe` layer's params are lingvo_ext's class's
    Params() holding the same values (the same variable names).
  """
  return _Rewrite(copy.deepcopy(params), [0])


def CountLingvoLayers(params):
  """How many Lingvo GPipe layers' params FromLingvo would replace."""
  count = [0]
  _Rewrite(copy.deepcopy(params), count)
  return count[0]


def ApplyEngine(params, engine):
  """`params` for --gpipe_engine=`engine`: FromLingvo'd, or as they are."""
  if engine not in ENGINES:
    raise ValueError(f'--gpipe_engine={engine}: use one of '
                     f'{", ".join(ENGINES)}.')
  return FromLingvo(params) if engine == 'lingvo_ext' else params
