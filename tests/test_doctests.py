"""The docstring examples of omnihvd's modules (unit tier: no torch, no Horovod).

Examples that need the installed stack are listed in ``doctests.NEEDS_INSTALL`` and
run by test_doctests_single.py.
"""
import pytest

import doctests

pytestmark = pytest.mark.unit

EXAMPLES = doctests.examples(needs_install=False)


def test_the_package_has_examples_in_this_tier():
    assert len(EXAMPLES) >= 30, sorted(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_docstring_example(name):
    failures, report = doctests.run(EXAMPLES[name])
    assert failures == 0, report
