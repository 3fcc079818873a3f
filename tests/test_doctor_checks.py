"""The pure parts of `omnihvd doctor`: reading /proc maps, naming MPI families, and
each check's verdict on given facts. The doctor run on a real install (and on broken
ones) is test_doctor.py."""
import os

import pytest

from omnihvd.tools import doctor
from omnihvd.tools.doctor import Check, core_mpi_libs, mpi_family

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


# ----------------------------------------------------------------- CPU quota

def fake_cgroup_root(tmp_path, quota_us, period_us, version="v1"):
    """A fake root with /proc/self/{mountinfo,cgroup} and this process's cpu cgroup."""
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    if version == "v1":
        (proc / "mountinfo").write_text(
            "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n")
        (proc / "cgroup").write_text("4:cpu,cpuacct:/docker/c1\n")
        group = tmp_path / "sys/fs/cgroup/cpu,cpuacct/docker/c1"
        group.mkdir(parents=True)
        (group / "cpu.cfs_quota_us").write_text("%d\n" % quota_us)
        (group / "cpu.cfs_period_us").write_text("%d\n" % period_us)
    else:
        (proc / "mountinfo").write_text("31 23 0:28 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
        (proc / "cgroup").write_text("0::/kubepods/pod1/c1\n")
        (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
        (tmp_path / "sys/fs/cgroup/cgroup.controllers").write_text("cpu memory\n")
        group = tmp_path / "sys/fs/cgroup/kubepods/pod1/c1"
        group.mkdir(parents=True)
        (group / "cpu.max").write_text("%s %d\n" % (quota_us if quota_us > 0 else "max", period_us))
    return str(tmp_path)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_cpu_quota_with_the_default_100ms_period_warns_with_the_fix(tmp_path, version):
    check = doctor._check_cpu_quota(root=fake_cgroup_root(tmp_path, 250000, 100000, version),
                                    cpus=3)
    assert check.status == "WARN", check
    assert "2.50 cores per 100 ms" in check.detail and "over 3 CPUs" not in check.detail
    assert "cpu-period" in check.fix and "docs/cpu-quotas.rst" in check.fix
    assert "--bind-to core" not in check.fix   # 3 CPUs for 2.5 cores: nothing to narrow


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_cpu_quota_on_more_cpus_than_it_allows_warns_with_the_fix(tmp_path, version):
    # 0.3 cores on 2 CPUs: MPI's thread polls beside the training thread
    check = doctor._check_cpu_quota(root=fake_cgroup_root(tmp_path, 3000, 10000, version),
                                    cpus=2)
    assert check.status == "WARN", check
    assert "a CPU quota of 0.30 cores over 2 CPUs" in check.detail
    assert "--cpuset-cpus" in check.fix and "--bind-to core" in check.fix
    assert "cpu-period" not in check.fix   # the 10 ms period is fine
    one = doctor._check_cpu_quota(root=fake_cgroup_root(tmp_path / "one", 3000, 10000, version),
                                  cpus=1)
    assert one.status == "OK", one
    both = doctor._check_cpu_quota(root=fake_cgroup_root(tmp_path / "b", 30000, 100000, version),
                                   cpus=4)
    assert both.status == "WARN" and "cpu-period" in both.fix and "--cpuset-cpus" in both.fix


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_cpu_quota_with_a_short_period_or_none_is_ok(tmp_path, version):
    short = doctor._check_cpu_quota(root=fake_cgroup_root(tmp_path / "a", 25000, 10000, version),
                                    cpus=3)
    assert short.status == "OK" and "2.50 cores per 10 ms" in short.detail
    none = doctor._check_cpu_quota(root=fake_cgroup_root(tmp_path / "b", -1, 100000, version),
                                   cpus=64)
    assert none == Check("CPU quota", "OK", "no CFS quota on this process")


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_long_period_that_cannot_throttle_is_ok(tmp_path, version):
    # 2 cores per 100 ms on 2 CPUs (exclusive cores under a quota, as Kubernetes' static
    # CPU manager sets): the period does not matter
    check = doctor._check_cpu_quota(root=fake_cgroup_root(tmp_path, 200000, 100000, version),
                                    cpus=2)
    assert check.status == "OK", check


def test_a_cpu_cgroup_that_cannot_be_seen_is_said(tmp_path):
    lost = fake_cgroup_root(tmp_path / "a", 30000, 100000)
    (tmp_path / "a/proc/self/cgroup").write_text("4:cpu,cpuacct:/../other\n")
    check = doctor._check_cpu_quota(root=lost, cpus=1)
    assert check.status == "WARN" and "cannot be read" in check.detail
    assert "cpu_quota=<cores>" in check.fix
    bare = tmp_path / "b/proc/self"
    bare.mkdir(parents=True)
    (bare / "mountinfo").write_text("31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n")
    (bare / "cgroup").write_text("")
    check = doctor._check_cpu_quota(root=str(tmp_path / "b"), cpus=1)
    assert check.status == "OK" and "no CFS quota can be seen" in check.detail


def test_a_long_period_on_a_group_whose_processes_use_more_cpus_warns(tmp_path):
    # A container's 1 core per 100 ms, shared by processes that may run on more CPUs
    # than this one (here: this test, on every CPU, while the check is told 1 CPU):
    # the group can be throttled although this process alone could not use more.
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs a process that may run on 2 CPUs or more")
    root = fake_cgroup_root(tmp_path, 100000, 100000)
    group = tmp_path / "sys/fs/cgroup/cpu,cpuacct/docker/c1"
    alone = doctor._check_cpu_quota(root=root, cpus=1)
    assert alone.status == "OK", alone
    (group / "cgroup.procs").write_text("%d\n" % os.getpid())
    shared = doctor._check_cpu_quota(root=root, cpus=1)
    assert shared.status == "WARN" and "cpu-period" in shared.fix, shared
