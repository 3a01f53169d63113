"""What tests/e2e/test_docs_examples.py checks the docs against.

- `FencedBlocks`: every fenced code block of README.md and docs/*.md, with
  the HTML comment on the line before its fence. Every shell and Python
  block carries one, saying how the tests check it:

      <!-- runnable -->              run it (shell: bash; python: the venv's)
      <!-- runnable: e2e -->         the same, marked e2e (runs a trainer...)
      <!-- runnable: cwd=repo -->    run it from the repository, not a tmp dir
      <!-- runnable: file=PATH -->   write the block to PATH (any language;
                                     for the later blocks of its page)
      <!-- runnable: after -->       run it right after the page's runnable
                                     block before it, sharing its /tmp/lx/
      <!-- runnable: env=NAME=VALUE -->        set it (python blocks)
      <!-- runnable: sub='OLD|NEW' -->         run it with OLD replaced by
                                     NEW (smaller sizes; OLD must occur)
      <!-- checked: commands -->     not run (other hosts, a cluster, a long
                                     benchmark): each trainer command in it
                                     passes the trainer's flag, cluster,
                                     model and params checks; each other
                                     python command (bench/, tools) its
                                     argparse parser; each `bash SCRIPT`'s
                                     script exists
                                     (tests/support/docs_commands_testlib.py)
      <!-- checked: flags base='COMMAND' -->   each line is flags that the
                                     trainer command COMMAND takes, checked
                                     as above
      <!-- checked: excerpt=PATH --> the block's lines are lines of PATH (a
                                     tested file), in order
      <!-- checked: bazel -->        each `//:target` is a BUILD target and
                                     each script it runs exists (no bazel in
                                     CI)

  Options combine, e.g. `<!-- runnable: e2e cwd=repo -->`; values are
  shell-quoted.
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
import shlex
from typing import List
from typing import Tuple

from tests.support import ROOT

DOC_FILES = ['README.md', 'docs/*.md']
# The languages whose blocks must say how they are checked.
CODE_LANGS = ('sh', 'bash', 'shell', 'console', 'python', 'py')

_MARKER = re.compile(r'^\s*<!--\s*(runnable|checked)(?::\s*(.*?))?\s*-->\s*$')
_FENCE = re.compile(r'^(\s*)```(\S*)\s*$')
_RUN_OPTIONS = ('e2e', 'cwd=repo', 'file=', 'after', 'env=', 'sub=')
_CHECK_KINDS = ('commands', 'flags', 'excerpt=', 'bazel')


@dataclasses.dataclass
class Block:
  path: str  # Relative to the repository.
  line: int  # Of the opening fence, 1-based.
  lang: str  # As the fence says: 'sh', 'python', 'text', ...
  code: str  # Without the fence's indentation.
  kind: str = ''  # 'runnable', 'checked' or '' (no marker).
  options: List[str] = dataclasses.field(default_factory=list)
  e2e: bool = False
  cwd_repo: bool = False
  file: str = ''  # Write the code there instead of running it.
  after: bool = False  # Run after the page's previous runnable block.
  env: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
  subs: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
  check: str = ''  # Of a checked block: 'commands', 'flags', ...
  base: str = ''  # Of checked: flags.
  excerpt: str = ''  # Of checked: excerpt=PATH.

  @property
  def id(self):
    return '%s:%d' % (self.path, self.line)

  def Code(self):
    """The code as the test runs it: with the marker's substitutions."""
    code = self.code
    for old, new in self.subs:
      if old not in code:
        raise ValueError('%s: sub %r: not in the block.' % (self.id, old))
      code = code.replace(old, new)
    return code


def _Option(block, option, where):
  """Sets one marker option on the block; ValueError when unknown."""
  if block.kind == 'runnable':
    if option == 'e2e':
      block.e2e = True
    elif option == 'cwd=repo':
      block.cwd_repo = True
    elif option == 'after':
      block.after = True
    elif option.startswith('file='):
      block.file = option[len('file='):]
    elif option.startswith('env=') and '=' in option[len('env='):]:
      block.env.append(tuple(option[len('env='):].split('=', 1)))
    elif option.startswith('sub=') and '|' in option:
      block.subs.append(tuple(option[len('sub='):].split('|', 1)))
    else:
      raise ValueError('%s: unknown runnable option %r (one of %s).' %
                       (where, option, ', '.join(_RUN_OPTIONS)))
  else:
    if option in ('commands', 'flags', 'bazel') and not block.check:
      block.check = option
    elif option.startswith('excerpt=') and not block.check:
      block.check, block.excerpt = 'excerpt', option[len('excerpt='):]
    elif option.startswith('base=') and block.check == 'flags':
      block.base = option[len('base='):]
    else:
      raise ValueError('%s: unknown checked option %r (one kind of %s).' %
                       (where, option, ', '.join(_CHECK_KINDS)))


def FencedBlocks() -> List[Block]:
  """Every fenced block of README.md and docs/*.md, in order."""
  blocks = []
  for pattern in DOC_FILES:
    for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
      with open(path, encoding='utf-8') as f:
        lines = f.read().split('\n')
      rel = os.path.relpath(path, ROOT)
      i = 0
      while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
          if _MARKER.match(lines[i]) and not (
              i + 1 < len(lines) and _FENCE.match(lines[i + 1])):
            raise ValueError('%s:%d: a marker must be right before a code '
                             'fence.' % (rel, i + 1))
          i += 1
          continue
        indent, lang = fence.groups()
        end = i + 1
        while end < len(lines) and lines[end].rstrip() != indent + '```':
          end += 1
        if end == len(lines):
          raise ValueError('%s:%d: the code block is not closed.' %
                           (rel, i + 1))
        code = '\n'.join(l[len(indent):] if l.startswith(indent) else l
                         for l in lines[i + 1:end])
        block = Block(rel, i + 1, lang, code)
        m = _MARKER.match(lines[i - 1]) if i else None
        if m:
          block.kind = m.group(1)
          for option in shlex.split(m.group(2) or ''):
            _Option(block, option, '%s:%d' % (rel, i))
          if block.kind == 'checked' and not block.check:
            raise ValueError('%s:%d: checked needs a kind (%s).' %
                             (rel, i, ', '.join(_CHECK_KINDS)))
          if (block.kind == 'runnable' and not block.file and
              lang not in ('sh', 'python')):
            raise ValueError('%s:%d: runnable blocks are sh or python, not '
                             '%r.' % (rel, i + 1, lang))
        blocks.append(block)
        i = end + 1
  return blocks


_INDENTED_COMMAND = re.compile(r'^ {4,}(\.venv/|bash |/usr/bin/|[A-Z_]+=\S* )')


def IndentedCommands() -> List[str]:
  """'path:line' of each indented (unfenced) code block holding a command."""
  out = []
  for pattern in DOC_FILES:
    for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
      with open(path, encoding='utf-8') as f:
        lines = f.read().split('\n')
      in_fence = False
      for i, line in enumerate(lines):
        if _FENCE.match(line):
          in_fence = not in_fence
        elif (not in_fence and i and not lines[i - 1].strip() and
              _INDENTED_COMMAND.match(line)):
          out.append('%s:%d' % (os.path.relpath(path, ROOT), i + 1))
  return out


def RunnableBlocks() -> List[Block]:
  """Every block marked runnable in README.md and docs/*.md, in order."""
  return [b for b in FencedBlocks() if b.kind == 'runnable']


def CheckedBlocks() -> List[Block]:
  """Every block marked checked, in order."""
  return [b for b in FencedBlocks() if b.kind == 'checked']


def Excerpt(block) -> str:
  """None when the block's lines are lines of its file, in order; or why."""
  with open(os.path.join(ROOT, block.excerpt), encoding='utf-8') as f:
    source = [l.strip() for l in f.read().split('\n')]
  at = 0
  for line in block.code.split('\n'):
    line = line.strip()
    if not line:
      continue
    try:
      at = source.index(line, at) + 1
    except ValueError:
      return '%s: %r is not in %s (after line %d)' % (block.id, line,
                                                      block.excerpt, at)
  return None


def BazelProblems(block) -> List[str]:
  """What a `checked: bazel` block names that BUILD or the tree lacks."""
  with open(os.path.join(ROOT, 'BUILD'), encoding='utf-8') as f:
    build = f.read()
  names = set(re.findall(r'name\s*=\s*"([^"]+)"', build))
  # One py_test per tests/**/test_*.py, named after its file.
  names |= {os.path.basename(p)[:-len('.py')] for p in glob.glob(
      os.path.join(ROOT, 'tests', '**', 'test_*.py'), recursive=True)}
  problems = []
  for target in re.findall(r'//:(\w+)', block.code):
    if target not in names:
      problems.append('%s: no target //:%s' % (block.id, target))
  for script in re.findall(r'(scripts/\S+\.sh)', block.code):
    if not os.path.exists(os.path.join(ROOT, script)):
      problems.append('%s: no %s' % (block.id, script))
  return problems


# --- error: lines ----------------------------------------------------------------

# Modules whose messages reach the user as `error: ...` lines.
_ERROR_MODULES = ['lingvo_ext/trainer.py', 'lingvo_ext/launch.py',
                  'lingvo_ext/registry.py', 'lingvo_ext/runtime/*.py',
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
