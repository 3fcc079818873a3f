"""`omnihvd doctor`: passes on this install, and names the problem and its fix on
broken ones (simulated by shadowing horovod or mpi4py on PYTHONPATH)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from omnihvd.tools import doctor

pytestmark = pytest.mark.single

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OMNIHVD = os.path.join(os.path.dirname(sys.executable), "omnihvd")


def run_doctor(*args, shadow=None, timeout=120):
    """Run the installed console script; ``shadow`` is a folder put first on PYTHONPATH."""
    assert os.path.exists(OMNIHVD), "no %s: run `bash tools/setup.sh`" % OMNIHVD
    env = dict(os.environ)
    if shadow is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shadow), env.get("PYTHONPATH")) if p)
    return subprocess.run([OMNIHVD, "doctor", *args], env=env, cwd=str(shadow or ROOT),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)


def by_name(proc):
    report = json.loads(proc.stdout)
    return {c["name"]: c for c in report["checks"]}


def make_package(root, name, files):
    """Write a fake package ``name`` under ``root``; ``files`` maps relative path -> source."""
    for rel, source in files.items():
        path = root / name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root


# ----------------------------------------------------------------- the real install

def test_doctor_passes_and_shows_horovod_built_with_pytorch_and_mpi():
    proc = run_doctor()
    assert proc.returncode == 0, proc.stdout
    lines = proc.stdout.splitlines()
    build = [ln for ln in lines if "horovod build" in ln]
    assert build and build[0].split()[0] == "OK", proc.stdout
    assert "PyTorch extension loads" in build[0] and "MPI" in build[0], build[0]
    assert "FAIL" not in proc.stdout
    assert lines[-1].startswith("everything needed works"), proc.stdout


def test_doctor_json_reports_every_needed_check_ok():
    proc = run_doctor("--json")
    assert proc.returncode == 0, proc.stdout
    checks = by_name(proc)
    for name in ("torch", "horovod", "horovod build", "mpi4py", "MPI threads",
                 "one MPI library", "horovod init", "launcher"):
        assert checks[name]["status"] == "OK", checks[name]
    assert checks["horovod"]["detail"].startswith(doctor.HOROVOD_VERSION)
    assert "MPI_THREAD_MULTIPLE" in checks["MPI threads"]["detail"]
    assert json.loads(proc.stdout)["facts"]["horovod_torch"]["mpi_built"] is True


def test_quiet_prints_no_ok_lines():
    proc = run_doctor("--quiet")
    assert proc.returncode == 0, proc.stdout
    assert not [ln for ln in proc.stdout.splitlines() if ln.split()[:1] == ["OK"]], proc.stdout


# ----------------------------------------------------------------- broken installs

FAKE_TORCH = """
__version__ = "2.13.0+cpu"
class cuda:
    is_available = staticmethod(lambda: False)
    device_count = staticmethod(lambda: 0)
class version:
    cuda = None
"""

def test_horovod_built_for_another_torch_fails_with_fix(tmp_path):
    shadow = make_package(tmp_path, "horovod", {
        "__init__.py": '__version__ = "0.28.1"\n',
        "torch/__init__.py": 'raise ImportError("mpi_lib_v2.so: undefined symbol: _ZN3c10")\n',
    })
    proc = run_doctor("--json", shadow=shadow)
    assert proc.returncode == 1, proc.stdout
    build = by_name(proc)["horovod build"]
    assert build["status"] == "FAIL" and "undefined symbol" in build["detail"]
    assert "tools/setup.sh" in build["fix"] and "another torch" in build["fix"]
    # The human form shows the fix under the failed line.
    text = run_doctor(shadow=shadow).stdout
    assert "FAIL  horovod build" in text and "fix: horovod was built against" in text


def test_horovod_without_mpi_fails(tmp_path):
    shadow = make_package(tmp_path, "horovod", {
        "__init__.py": '__version__ = "0.28.1"\n',
        "torch/__init__.py": """
            def mpi_built(): return False
            def gloo_built(): return True
            def nccl_built(): return 0
            def cuda_built(): return False
            def init(): raise ValueError("Horovod has not been built with MPI support.")
        """,
    })
    proc = run_doctor("--json", shadow=shadow)
    assert proc.returncode == 1, proc.stdout
    checks = by_name(proc)
    assert checks["horovod build"]["status"] == "FAIL"
    assert "HOROVOD_WITH_MPI=1" in checks["horovod build"]["fix"]
    assert checks["horovod init"]["status"] == "FAIL"


def test_horovod_missing_fails(tmp_path):
    shadow = make_package(tmp_path, "horovod", {
        "__init__.py": 'raise ModuleNotFoundError("No module named \'horovod\'")\n'})
    proc = run_doctor("--json", shadow=shadow)
    assert proc.returncode == 1, proc.stdout
    h = by_name(proc)["horovod"]
    assert h["status"] == "FAIL" and "tools/setup.sh" in h["fix"]


def test_mpi4py_that_cannot_load_mpi_fails(tmp_path):
    shadow = make_package(tmp_path, "mpi4py", {
        "__init__.py": '__version__ = "4.1.2"\nclass rc: thread_level = "multiple"\n',
        "MPI.py": 'raise ImportError("libmpi.so.40: cannot open shared object file")\n',
    })
    proc = run_doctor("--json", shadow=shadow)
    assert proc.returncode == 1, proc.stdout
    checks = by_name(proc)
    assert checks["mpi4py"]["status"] == "FAIL"
    assert "libmpi.so.40" in checks["mpi4py"]["detail"]
    assert "pip install" in checks["mpi4py"]["fix"]
    assert checks["horovod build"]["status"] == "OK"  # the rest is still checked


def test_hang_is_cut_off_and_reported(tmp_path):
    make_package(tmp_path, "torch", {"__init__.py": FAKE_TORCH})  # fast, even on a busy machine
    shadow = make_package(tmp_path, "horovod", {
        "__init__.py": "import time\ntime.sleep(600)\n"})
    proc = run_doctor("--json", "--timeout", "5", shadow=shadow, timeout=90)
    assert proc.returncode == 1, proc.stdout
    checks = by_name(proc)
    stopped = checks["check process"]
    assert stopped["status"] == "FAIL" and "timed out during import horovod" in stopped["detail"]
    assert checks["torch"]["status"] == "OK"  # facts gathered before the hang survive
    assert checks["horovod"]["status"] == "SKIP"


def test_crash_is_reported(tmp_path):
    shadow = make_package(tmp_path, "horovod", {
        "__init__.py": '__version__ = "0.28.1"\n',
        "torch/__init__.py": "import os\nos.abort()\n"})
    proc = run_doctor("--json", shadow=shadow)
    assert proc.returncode == 1, proc.stdout
    stopped = by_name(proc)["check process"]
    assert "SIGABRT" in stopped["detail"] and "import horovod.torch" in stopped["detail"]


def test_doctor_reports_the_cpu_quota_line():
    checks = by_name(run_doctor("--json"))
    assert checks["CPU quota"]["status"] in ("OK", "WARN")
