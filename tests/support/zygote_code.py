"""`python -c CODE ARGS...` as a module: tests/support/zygote.py forks them.

tests/support/zygote.py runs `[python, '-c', CODE, *ARGS]` as `[python, '-m',
'tests.support.zygote_code', CODE, *ARGS]` from its server, which has imported
TensorFlow and Lingvo; this runs CODE as `-c` would: as __main__ in a fresh
module named '__main__', sys.argv ['-c', *ARGS], sys.path[0] '' (the working
folder), an uncaught exception's traceback (from CODE's frame on) and exit
code 1 as the interpreter's.
"""

import sys
import types


def Main():
  code, args = sys.argv[1], sys.argv[2:]
  sys.argv = ['-c'] + args
  sys.path[0] = ''
  main = types.ModuleType('__main__')
  main.__builtins__ = __builtins__
  sys.modules['__main__'] = main
  try:
    exec(compile(code, '<string>', 'exec'), main.__dict__)  # pylint: disable=exec-used
  except Exception as e:  # pylint: disable=broad-except
    # The traceback from CODE's frame on, as the interpreter prints it.
    e.__traceback__ = e.__traceback__.tb_next
    sys.excepthook(type(e), e, e.__traceback__)
    sys.exit(1)


if __name__ == '__main__':
  Main()
