"""Lingvo's x_ops.so loads here (after the install-time fix) and its ops run."""

import subprocess
import sys

import lingvo.compat as tf
from lingvo.core import ops
import numpy as np
import pytest

from lingvo_ext.tools import fix_x_ops


def test_x_ops_op_runs():
  with tf.Graph().as_default(), tf.Session() as sess:
    ids, labels, paddings = ops.ascii_to_token_id(['ab'], append_eos=True,
                                                  maxlen=4)
    ids, labels, paddings = sess.run([ids, labels, paddings])
  # Lingvo's ASCII vocab: <s>=1, </s>=2, 'a'=5, 'b'=6; ids start with <s>,
  # labels end with </s>, and the 4th slot is padding.
  np.testing.assert_array_equal(ids, [[1, 5, 6, 2]])
  np.testing.assert_array_equal(labels, [[5, 6, 2, 2]])
  np.testing.assert_array_equal(paddings, [[0, 0, 0, 1]])


@pytest.mark.e2e  # The fixer's command line, in a subprocess.
def test_fix_is_a_no_op_where_it_loads():
  tool = [sys.executable, '-m', 'lingvo_ext.tools.fix_x_ops']
  r = subprocess.run(tool + ['--force'], capture_output=True, text=True,
                     check=True)
  assert 'loads; nothing to do' in r.stdout, r.stdout
  # Recorded: the next run does not load it again.
  r = subprocess.run(tool, capture_output=True, text=True, check=True)
  assert 'loaded when last checked and is unchanged' in r.stdout, r.stdout


def test_a_recorded_load_holds_for_those_bytes_only(tmp_path, capsys):
  lib = tmp_path / 'x_ops.so'
  lib.write_bytes(b'not a library')
  (tmp_path / 'x_ops.so.loads').write_text(fix_x_ops.LoadsKey(str(lib)))
  # Recorded and unchanged: not loaded (this file would not load).
  assert fix_x_ops.main(['--lib', str(lib)]) == 0
  assert 'unchanged; nothing to do' in capsys.readouterr().out
  key = fix_x_ops.LoadsKey(str(lib))
  lib.write_bytes(b'not a library either')
  assert fix_x_ops.LoadsKey(str(lib)) != key


def test_patched_library_needs_no_new_symbol_versions():
  # Where a patch happened, the renamed symbols and weak needs are in place.
  import os  # pylint: disable=g-import-not-at-top
  lib = fix_x_ops.DefaultLibPath()
  if not os.path.exists(lib + '.orig'):
    return  # This system's glibc loads the original; nothing was patched.
  with open(lib, 'rb') as f:
    data = f.read()
  elf = fix_x_ops.ReadElf(lib)
  symbols = set(elf.DynamicSymbols())
  flags = {name: f for _, name, f in elf.VersionNeeds()}
  for old, version, new in fix_x_ops.RENAMES:
    assert old not in symbols and new in symbols, (old, new)
    assert flags[version] & fix_x_ops.VER_FLG_WEAK, version
  # The original needs them strongly: that is what failed to load.
  orig = {name: f for _, name, f in fix_x_ops.ReadElf(lib + '.orig')
          .VersionNeeds()}
  assert not any(orig[v] & fix_x_ops.VER_FLG_WEAK
                 for _, v, _ in fix_x_ops.RENAMES)
  # Patching the backup again reproduces the installed file byte for byte.
  import tempfile  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, 'x_ops.so')
    fix_x_ops.Patch(lib + '.orig', out)
    with open(out, 'rb') as f:
      assert f.read() == data
