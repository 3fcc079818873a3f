"""Test tiers: every test file belongs to exactly one.

How a file picks its tier: it says so at module level with one line,
``pytestmark = pytest.mark.unit`` (or ``single``, ``mpi``, ``cluster``), and that
line is the only tier marker in the file; a feature tested in several tiers gets one
file per tier (``test_faults.py`` unit, ``test_faults_mpi.py`` mpi). Pick the lowest
tier whose environment the test needs: ``unit`` when numpy, pytest, hypothesis and
the standard library are enough (its module-level imports must stay within those and
omnihvd's pure modules: ``tests/test_tiers.py`` imports every unit file with torch,
horovod, mpi4py and matplotlib blocked); ``single`` when it needs the installed stack
in one process (torch, Horovod, matplotlib, the ``omnihvd`` command, the dataset);
``mpi`` when it launches several ranks under a real ``mpirun``; ``cluster`` when it
starts a real Slurm or an elastic ``horovodrun``. A test file without a tier, or with
two, stops the whole run at collection with the file's name, so none is forgotten.
The tier is read from the source, before the file is imported, so ``pytest -m unit``
imports no file of another tier and runs where torch and Horovod are not installed.
Doctests of the package run as tests too: ``test_doctests.py`` (unit) and
``test_doctests_single.py`` (the examples that need torch or the install, listed in
``doctests.py``).
"""
import ast
import os
import re
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# The helpers next to the tests (mpirun.py, doctests.py), and this checkout's omnihvd
# before any installed one, so `pytest -m unit` runs from a bare clone.
sys.path[:0] = [HERE, ROOT]

TIERS = {
    "unit": "numpy, pytest and hypothesis only: runs without torch, Horovod or mpi4py",
    "single": "the installed stack (torch, Horovod, matplotlib, the omnihvd command), "
              "one process",
    "mpi": "several ranks under a real mpirun",
    "cluster": "a real local Slurm cluster, or elastic horovodrun",
}
_RULE = ("add one module-level line `pytestmark = pytest.mark.<tier>` with tier one of %s "
         "(the rule is in tests/conftest.py)" % ", ".join(TIERS))


def pytest_configure(config):
    for name, meaning in TIERS.items():
        config.addinivalue_line("markers", "%s: test tier: %s" % (name, meaning))


def _marker_names(node):
    """``pytest.mark.X`` (or a list/tuple of such) -> the X's."""
    items = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node]
    names = []
    for item in items:
        if isinstance(item, ast.Call):  # pytest.mark.X(...)
            item = item.func
        if (isinstance(item, ast.Attribute) and isinstance(item.value, ast.Attribute)
                and item.value.attr == "mark"):
            names.append(item.attr)
    return names


def file_tiers(path):
    """The tiers a test file declares, read from its source without importing it.

    Counts module-level ``pytestmark = ...`` assignments and any ``pytest.mark.<tier>``
    written elsewhere in the file (a decorator, a parametrize ``marks=``), so a file
    that mixes tiers shows up as having two.
    """
    with open(str(path), encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in TIERS and isinstance(
                node.value, ast.Attribute) and node.value.attr == "mark":
            found.append(node.attr)
    declared = [name for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
                for name in _marker_names(node.value) if name in TIERS]
    return declared, sorted(set(found))


_EXPR = re.compile(r"^(\s|\(|\)|\band\b|\bor\b|\bnot\b|\b(%s)\b)*$" % "|".join(TIERS))


def _tier_selected(markexpr, tier):
    """Whether ``-m markexpr`` can select a test of ``tier``; None when it cannot be
    told from the tier alone (the expression names other markers)."""
    if not markexpr.strip() or not _EXPR.match(markexpr):
        return None
    text = re.sub(r"\b(%s)\b" % "|".join(TIERS),
                  lambda m: "True" if m.group(1) == tier else "False", markexpr)
    try:
        return bool(eval(text, {"__builtins__": {}}))  # only True/False/and/or/not/()
    except SyntaxError:
        return None


def _is_test_file(path):
    name = os.path.basename(path)
    return name.startswith("test_") and name.endswith(".py") and os.path.dirname(path) == HERE


def tier_problem(path):
    """None when a test file declares exactly one tier, else what is wrong with it."""
    declared, found = file_tiers(path)
    tiers = sorted(set(declared) | set(found))
    if len(tiers) > 1:
        return "mixes the tiers %s (split it: one file per tier)" % ", ".join(tiers)
    if not declared:
        return "declares no test tier" + (" (%s is marked on single tests only)" % tiers[0]
                                          if tiers else "")
    if len(declared) > 1:
        return "declares its tier more than once"
    return None


class _TierError(pytest.File):
    """Stands for a test file without one tier: its collection fails with the rule."""

    def collect(self):
        raise self.CollectError("%s %s: %s" % (self.path.name, tier_problem(self.path), _RULE))


def pytest_ignore_collect(collection_path, config):
    path = str(collection_path)
    if _is_test_file(path) and tier_problem(path) is None:
        tier = file_tiers(path)[0][0]
        if _tier_selected(config.getoption("markexpr") or "", tier) is False:
            return True  # not imported at all: -m unit must run without torch and Horovod
    return None


def pytest_collect_file(file_path, parent):
    if _is_test_file(str(file_path)) and tier_problem(file_path) is not None:
        return _TierError.from_parent(parent, path=file_path)
    return None


@pytest.fixture(scope="session")
def horovod():
    """``horovod.torch``, initialised: in plain pytest (no mpirun) a world of one rank.

    The single tier's files ask for it (``pytest.mark.usefixtures("horovod")`` or an
    argument). Horovod is imported here, not at the top: the unit tier runs without it.
    """
    import horovod.torch as hvd
    hvd.init()
    assert hvd.size() == 1, "the single tier runs without mpirun"
    return hvd
