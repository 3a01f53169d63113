"""lingvo_ext/_internal/__init__.py: the versions whose internals the tests
of tests/_internal/ check (PINNED)."""


from lingvo_ext import _internal


def testPinnedVersionsAreInstalled():
  assert not _internal.VersionMismatches(), (
      f'installed versions differ from lingvo_ext/_internal.PINNED: '
      f'{_internal.VersionMismatches()}; run tests/_internal/ and '
      'update the pins.')
