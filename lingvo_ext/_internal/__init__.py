"""The private TensorFlow and Lingvo symbols lingvo_ext relies on, in one place.

Everything else in lingvo_ext uses public APIs only. Each symbol here has a
test in tests/_internal/ that fails, naming the symbol, when an upgrade
removes or changes it; `PINNED` names the versions they were checked against
(requirements.txt, requirements-nodeps.txt).

- `tf.py`: TensorFlow internals (a control-flow switch, MatMul's gradient,
  SaveableObject, a local server's config, variable slices, op ids,
  tf.function names that XLA's compile cache finds again).
- `lingvo.py`: Lingvo internals (the model registry's map, the layer stack,
  the checkpointer's saveable variables, layers' private variables, param
  descriptions).
- `process.py`: leaving the process at once from a runner thread.
- `deferred.py`: optional modules TensorFlow's and Lingvo's imports load but a
  run never uses (scikit-learn, scipy.stats), imported at first use.
"""

from importlib import metadata

# The versions whose internals tests/_internal/ checks.
PINNED = {'tensorflow': '2.21.0', 'lingvo': '0.14.2'}


def VersionMismatches():
  """['tensorflow 2.22.0 (pinned 2.21.0)', ...]: installed != PINNED."""
  out = []
  for name, pinned in sorted(PINNED.items()):
    try:
      installed = metadata.version(name)
    except metadata.PackageNotFoundError:
      installed = 'missing'
    if installed != pinned:
      out.append(f'{name} {installed} (pinned {pinned})')
  return out
