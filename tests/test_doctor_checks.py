"""The pure parts of `omnihvd doctor`: reading /proc maps, naming MPI families, and
each check's verdict on given facts. The doctor run on a real install (and on broken
ones) is test_doctor.py."""
import pytest

from omnihvd import doctor
from omnihvd.doctor import Check, core_mpi_libs, mpi_family

pytestmark = pytest.mark.unit


def test_core_mpi_libs_keeps_the_library_not_its_bindings():
    maps = "\n".join("7f00-7f01 r-xp 00000000 08:01 1 " + p for p in (
        "/usr/lib/libmpi.so.40.30.4", "/usr/lib/libmpi_cxx.so.40.30.1",
        "/opt/mpich/lib/libmpich.so.12", "/opt/cray/libmpi_cray.so.12",
        "/usr/lib/libmpi_mpifh.so.40", "/usr/lib/libompitrace.so.40"))
    maps += "\n7f02-7f03 rw-p 00000000 00:00 0 \n7f04-7f05 r--p 0 0:0 0 [heap]\n"
    assert core_mpi_libs(maps) == ["/opt/cray/libmpi_cray.so.12", "/opt/mpich/lib/libmpich.so.12",
                                   "/usr/lib/libmpi.so.40.30.4"]


@pytest.mark.parametrize("text, family", [
    ("mpirun (Open MPI) 4.1.4", "Open MPI"),
    ("Open MPI v4.1.4, package: Debian OpenMPI", "Open MPI"),
    ("HYDRA build details:", "MPICH"),
    ("MPICH Version:      4.0.2", "MPICH"),
    ("Intel(R) MPI Library 2021.9 for Linux* OS", "MPICH"),
    ("MVAPICH2 Version      :\t2.3.7", "MPICH"),
    ("slurm 22.05.8", None),
])
def test_mpi_family(text, family):
    assert mpi_family(text) == family


def mpi4py_facts(**changes):
    facts = {"version": "4.1.2", "rc_thread_level": "multiple", "mpi_version": "3.1",
             "library_version": "Open MPI v4.1.4, package: Debian OpenMPI",
             "thread_provided": 3, "thread_multiple": 3,
             "libmpi": ["/usr/lib/libmpi.so.40"], "libmpi_added": []}
    facts.update(changes)
    return facts


def test_two_mpi_libraries_fail():
    facts = {"horovod_torch": {"libmpi": ["/usr/lib/libmpi.so.40"]},
             "mpi4py": mpi4py_facts(libmpi_added=["/opt/mpich/lib/libmpi.so.12"])}
    check = doctor._check_same_mpi(facts)
    assert check.status == "FAIL" and "/opt/mpich/lib/libmpi.so.12" in check.detail
    assert "--no-binary mpi4py" in check.fix


def test_mpi_without_thread_multiple_fails():
    check = doctor._check_threads({"mpi4py": mpi4py_facts(thread_provided=2)})
    assert check == Check("MPI threads", "FAIL", "this MPI provides only MPI_THREAD_SERIALIZED",
                          check.fix) and "MPI_THREAD_MULTIPLE" in check.fix


def test_launcher_from_another_mpi_fails():
    # This machine's mpirun is Open MPI; pretend the processes load MPICH.
    check = doctor._check_launcher({"mpi4py": mpi4py_facts(
        library_version="MPICH Version: 4.0.2")})
    assert check.status == "FAIL" and "size 1" in check.detail and "PATH" in check.fix


def test_old_torch_fails():
    check = doctor._check_torch({"torch": {"version": "2.0.1+cu118"}})
    assert check.status == "FAIL" and ">= 2.1" in check.fix
