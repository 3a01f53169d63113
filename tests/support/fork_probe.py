"""Run by tests/distributed/test_fork_server.py: `python -m tests.support.fork_probe`.

Prints, as one JSON line, what a program sees of how it was started; then
exits as its first argument says: an exit code, 'signal' (SIGTERM itself),
'raise' (an uncaught exception) or 'sleep' (until killed). At interpreter
shutdown an object's finalizer writes one more line, as TensorFlow's event
writers flush their files then.
"""

import json
import os
import signal
import sys
import time

import numpy as np


class _Finalized:

  def __del__(self):
    sys.stdout.write('finalized\n')
    sys.stdout.flush()


_KEEP = _Finalized()

if __name__ == '__main__':
  print(json.dumps(dict(
      argv=sys.argv[1:], cwd=os.getcwd(), path0=sys.path[0],
      probe=os.environ.get('PROBE'), tf_config=os.environ.get('TF_CONFIG'),
      stdin=sys.stdin.read(), pgid_is_pid=os.getpgid(0) == os.getpid(),
      numpy=float(np.random.rand()))), flush=True)
  what = sys.argv[1]
  if what == 'signal':
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
  elif what == 'raise':
    raise ValueError('probe raised')
  elif what == 'sleep':
    time.sleep(300)
  sys.exit(int(what))
