"""lingvo_ext's tests, laid out like the package (docs/architecture.md).

`tests/<folder>/` holds the tests of `lingvo_ext/<folder>/`, `tests/e2e/` the
whole-command runs (trainer, launcher, docs examples) and `tests/support/`
what the tests share. Every folder is a package: module names stay unique.
"""
