"""What tests/test_docs_examples.py checks the docs against.

- `RunnableBlocks`: the code blocks of README.md and docs/*.md marked
  runnable by an HTML comment on the line before the fence:

      <!-- runnable -->              run it (shell: bash; python: the venv's)
      <!-- runnable: e2e -->         the same, marked e2e (runs a trainer...)
      <!-- runnable: cwd=repo -->    run it from the repository, not a tmp dir
      <!-- runnable: file=PATH -->   write the block to PATH, do not run it

  Options combine, e.g. `<!-- runnable: e2e cwd=repo -->`.
- `ErrorTemplates`: the `error:` lines the tools print, read from the code:
  what is printed after 'error: ', what the flag and model checks return
  (printed as `error: <message>`), what the tools' Fail helpers print, and
  the ValueErrors that name a flag (the entry points print them); each as
  its literal text with '{}' where a value goes.
"""

import ast
import dataclasses
import glob
import os
import re
from typing import List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_FILES = ['README.md', 'docs/*.md']

_MARKER = re.compile(r'^<!--\s*runnable(?::\s*(.*?))?\s*-->\s*$')
_FENCE = re.compile(r'^```(\w+)')


@dataclasses.dataclass
class Block:
  path: str  # Relative to the repository.
  line: int  # Of the opening fence, 1-based.
  lang: str  # 'sh' or 'python'.
  code: str
  e2e: bool = False
  cwd_repo: bool = False
  file: str = ''  # Write the code there instead of running it.

  @property
  def id(self):
    return '%s:%d' % (self.path, self.line)


def RunnableBlocks() -> List[Block]:
  """Every block marked runnable in README.md and docs/*.md, in order."""
  blocks = []
  for pattern in DOC_FILES:
    for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
      with open(path, encoding='utf-8') as f:
        lines = f.read().split('\n')
      rel = os.path.relpath(path, ROOT)
      for i, line in enumerate(lines):
        m = _MARKER.match(line)
        if not m:
          continue
        fence = _FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if not fence:
          raise ValueError('%s:%d: a runnable marker must be right before a '
                           '```sh or ```python fence.' % (rel, i + 1))
        end = lines.index('```', i + 2)
        options = (m.group(1) or '').split()
        block = Block(rel, i + 2, fence.group(1), '\n'.join(lines[i + 2:end]))
        for option in options:
          if option == 'e2e':
            block.e2e = True
          elif option == 'cwd=repo':
            block.cwd_repo = True
          elif option.startswith('file='):
            block.file = option[len('file='):]
          else:
            raise ValueError('%s:%d: unknown runnable option %r.' %
                             (rel, i + 1, option))
        if block.lang not in ('sh', 'python'):
          raise ValueError('%s:%d: runnable blocks are sh or python, not %r.'
                           % (rel, i + 2, block.lang))
        blocks.append(block)
  return blocks


# --- error: lines ----------------------------------------------------------------

# Modules whose messages reach the user as `error: ...` lines.
_ERROR_MODULES = ['lingvo_ext/trainer.py', 'lingvo_ext/launch.py',
                  'lingvo_ext/registry.py', 'lingvo_ext/runners.py',
                  'lingvo_ext/distributed/*.py', 'lingvo_ext/tools/*.py']
# Functions whose returned strings the entry points print as `error: ...`.
_CHECKERS = re.compile(r'^_?(Check|Resolve|Lock|UnknownModel|AutoPlan)')
# Calls whose first argument is printed as `error: ...`.
_FAILS = ('Fail', '_Fail', '_Exit')


def _Lead(node):
  """The literal text of a str expression, '{}' for each value; or None."""
  if isinstance(node, ast.Constant) and isinstance(node.value, str):
    return node.value
  if isinstance(node, ast.JoinedStr):
    return ''.join(v.value if isinstance(v, ast.Constant) else '{}'
                   for v in node.values)
  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
    return (_Lead(node.left) or '{}') + (_Lead(node.right) or '{}')
  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
    left = _Lead(node.left)
    return re.sub(r'%[-\d.]*[sdrf]', '{}', left) if left else None
  return None


def _CallName(call):
  f = call.func
  return f.id if isinstance(f, ast.Name) else getattr(f, 'attr', '')


def ErrorTemplates() -> List[Tuple[str, int, str]]:
  """[(path, line, template)] of every `error:` line the tools print."""
  out = []
  paths = sorted({p for pattern in _ERROR_MODULES
                  for p in glob.glob(os.path.join(ROOT, pattern))})
  for path in paths:
    rel = os.path.relpath(path, ROOT)
    with open(path, encoding='utf-8') as f:
      tree = ast.parse(f.read())
    for fn in ast.walk(tree):
      if not isinstance(fn, ast.FunctionDef):
        continue
      checker = _CHECKERS.match(fn.name)
      for n in ast.walk(fn):
        text = None
        if isinstance(n, ast.Call) and n.args:
          lead = _Lead(n.args[0])
          if lead and lead.startswith('error: '):
            text = lead[len('error: '):]
          elif lead and _CallName(n) in _FAILS:
            text = lead
        elif (isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call) and
              n.exc.args and _CallName(n.exc) == 'ValueError'):
          # A ValueError naming a flag: the entry points print it as an
          # `error:` line.
          lead = _Lead(n.exc.args[0])
          if lead and lead.startswith('--'):
            text = lead
        elif checker and isinstance(n, ast.Return) and n.value is not None:
          value = n.value
          if isinstance(value, ast.Tuple) and value.elts:  # (error, ...).
            value = value.elts[0]
          text = _Lead(value)
        # A message made elsewhere, passed on: its maker is checked there.
        if text and re.search(r'[A-Za-z]{3}', text.replace(
            '(--help lists the flags)', '')):
          out.append((rel, n.lineno, text))
  return out


def Words(text: str) -> str:
  return ' '.join(text.split())


def LongestLiteral(template: str) -> str:
  """The longest run of literal text between the template's values."""
  return max((Words(p) for p in template.split('{}')), key=len)
