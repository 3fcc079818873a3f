"""The test tiers themselves (tests/conftest.py): how a file's tier is read, how
``-m`` selects files, and that unit files import nothing heavy."""
import os
import subprocess
import sys
import textwrap

import pytest

import conftest

pytestmark = pytest.mark.unit

HEAVY = ("torch", "horovod", "mpi4py", "matplotlib")


def tiers_of(tmp_path, source):
    path = tmp_path / "test_x.py"
    path.write_text(textwrap.dedent(source))
    return conftest.file_tiers(path)


def test_a_file_declares_its_tier_once_at_module_level(tmp_path):
    assert tiers_of(tmp_path, "import pytest\npytestmark = pytest.mark.unit\n") == (
        ["unit"], ["unit"])
    assert tiers_of(tmp_path, "import pytest\npytestmark = [pytest.mark.mpi, pytest.mark.slow]\n"
                    ) == (["mpi"], ["mpi"])
    assert tiers_of(tmp_path, "def test_a():\n    pass\n") == ([], [])


def test_a_tier_marked_on_one_test_is_seen(tmp_path):
    source = """
        import pytest
        pytestmark = pytest.mark.unit

        @pytest.mark.mpi
        def test_a():
            pass
    """
    assert tiers_of(tmp_path, source) == (["unit"], ["mpi", "unit"])


@pytest.mark.parametrize("expr, tier, selected", [
    ("unit", "unit", True), ("unit", "mpi", False), ("not mpi", "single", True),
    ("unit or single", "mpi", False), ("not (mpi or cluster)", "cluster", False),
    ("", "unit", None),             # no -m: nothing is skipped by tier
    ("unit and slow", "unit", None),  # other markers: pytest decides per test
    ("__import__('os')", "unit", None),
])
def test_marker_expression_selects_files_by_tier(expr, tier, selected):
    assert conftest._tier_selected(expr, tier) is selected


def test_every_test_file_has_exactly_one_tier():
    for name in sorted(os.listdir(conftest.HERE)):
        if name.startswith("test_") and name.endswith(".py"):
            declared, found = conftest.file_tiers(os.path.join(conftest.HERE, name))
            assert len(declared) == 1 and found == declared, (name, declared, found)


def test_unit_files_import_without_torch_horovod_mpi4py_or_matplotlib():
    units = sorted(name[:-3] for name in os.listdir(conftest.HERE)
                   if name.startswith("test_") and name.endswith(".py")
                   and conftest.file_tiers(os.path.join(conftest.HERE, name))[0] == ["unit"])
    assert "test_controller" in units and "test_doctests" in units
    code = ("import sys\n"
            "for name in %r: sys.modules[name] = None  # import raises ImportError\n"
            "import importlib\n"
            "for name in %r: importlib.import_module(name)\n" % (HEAVY, units))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [conftest.HERE, os.path.dirname(conftest.HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=conftest.HERE,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
