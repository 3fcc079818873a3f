"""The docstring examples that need torch, Horovod or the complete install
(``doctests.NEEDS_INSTALL``); the others run in the unit tier (test_doctests.py)."""
import pytest

import doctests

pytestmark = pytest.mark.single

EXAMPLES = doctests.examples(needs_install=True)


def test_every_listed_entry_has_examples():
    # a stale entry would silently move nothing
    for entry in doctests.NEEDS_INSTALL:
        assert any(n == entry or n.startswith(entry + ".") for n in EXAMPLES), entry


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_docstring_example(name):
    failures, report = doctests.run(EXAMPLES[name])
    assert failures == 0, report


@pytest.mark.parametrize("name", doctests.module_names())
def test_every_exported_name_exists(name):
    # `from omnihvd.X import *` fails on a name in __all__ that X does not define
    import importlib
    module = importlib.import_module(name)
    missing = [n for n in getattr(module, "__all__", ()) if not hasattr(module, n)]
    assert not missing, "%s.__all__ names what it does not define: %s" % (name, missing)
