"""Saves the seconds each test took, from pytest's cache, in the repository.

  .venv/bin/python scripts/save_test_seconds.py

After a whole run of `bash scripts/test.sh` on a quiet machine: writes
tests/test_seconds.json, which a fresh clone (CI's) sorts its tests by,
longest first, where it has no cache (tests/conftest.py).
"""

import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CACHE = os.path.join(_ROOT, '.pytest_cache', 'v', 'lingvo_ext',
                      'test_seconds')
_SAVED = os.path.join(_ROOT, 'tests', 'test_seconds.json')


def main() -> int:
  try:
    with open(_CACHE) as f:
      seconds = json.load(f)
  except (OSError, ValueError) as e:
    print(f'error: no test times in {_CACHE} ({e}); run bash scripts/test.sh '
          'first.', file=sys.stderr)
    return 2
  with open(_SAVED, 'w') as f:
    json.dump({k: round(v, 1) for k, v in sorted(seconds.items())}, f,
              indent=0)
    f.write('\n')
  print(f'{_SAVED}: {len(seconds)} tests')
  return 0


if __name__ == '__main__':
  sys.exit(main())
