"""omnihvd.cpuquota (reading quotas from fake cgroup trees: v1, v2, containers, none)
and omnihvd.tools.cpulimits (quota groups on a fake tree; as root on a machine with
the cpu controller, real pinning and a real quota group around a live process)."""
import os
import subprocess
import sys
import time

import pytest

from omnihvd import cpuquota
from omnihvd.tools import cpulimits
from omnihvd.tools.cpulimits import CpuLimitError, Quota, QuotaGroup

pytestmark = pytest.mark.unit

V1_MOUNT = "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n" \
           "32 31 0:29 %s /sys/fs/cgroup/cpu%s rw - cgroup cgroup rw,%s\n" \
           "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
V2_MOUNT = "31 23 0:28 %s /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"


def fake_tree(tmp_path, mountinfo, cgroup, files):
    """A fake root: /proc/self/{mountinfo,cgroup} and cgroup files (path -> text)."""
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "mountinfo").write_text(mountinfo)
    (proc / "cgroup").write_text(cgroup)
    for rel, text in files.items():
        path = tmp_path / rel.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def test_parse_mountinfo_reads_cgroup_mounts_and_escapes():
    text = (V1_MOUNT % ("/", r"\040x", "cpu,cpuacct")
            + "50 23 0:40 / /proc rw - proc proc rw\n")
    mounts = cpuquota.parse_mountinfo(text)
    assert [(m["fstype"], m["mount"]) for m in mounts] == [
        ("cgroup", "/sys/fs/cgroup/cpu x"), ("cgroup2", "/sys/fs/cgroup/unified")]
    assert {"cpu", "cpuacct"} <= mounts[0]["options"]


def test_v1_quota_of_own_group_and_ancestor(tmp_path):
    root = fake_tree(tmp_path, V1_MOUNT % ("/", "", "cpu"), "1:cpu:/job/rank0\n0::/\n", {
        "/sys/fs/cgroup/cpu/job/rank0/cpu.cfs_quota_us": "30000\n",
        "/sys/fs/cgroup/cpu/job/rank0/cpu.cfs_period_us": "100000\n",
        "/sys/fs/cgroup/cpu/job/cpu.cfs_quota_us": "-1\n",
        "/sys/fs/cgroup/cpu/job/cpu.cfs_period_us": "100000\n",
        "/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "200000\n",
        "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "10000\n",
    })
    quotas = cpuquota.cpu_quotas(root=root)
    assert [(q.quota_us, q.period_us) for q in quotas] == [(30000, 100000), (200000, 10000)]
    assert quotas[0].cores == pytest.approx(0.3)
    assert quotas[0].path.endswith("/sys/fs/cgroup/cpu/job/rank0")
    # the timer's floor uses the binding (smallest) quota along the path
    assert cpuquota.cpu_quota_cores(root=root) == pytest.approx(0.3)
    (tmp_path / "sys/fs/cgroup/cpu/job/rank0/cpu.cfs_quota_us").write_text("-1\n")
    assert cpuquota.cpu_quota_cores(root=root) == pytest.approx(20.0)   # the ancestor binds


def test_v1_inside_a_container_sees_its_own_group_at_the_mount(tmp_path):
    # Without a cgroup namespace the container's path is /docker/ID and the mount shows
    # exactly that group.
    root = fake_tree(tmp_path, V1_MOUNT % ("/docker/abc", "", "cpu,cpuacct"),
                     "4:cpu,cpuacct:/docker/abc\n", {
                         "/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "150000\n",
                         "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"})
    assert cpuquota.cpu_quotas(root=root) == [
        Quota(os.path.join(root, "sys/fs/cgroup/cpu"), 150000, 100000)]


def test_v2_cpu_max(tmp_path):
    root = fake_tree(tmp_path, V2_MOUNT % "/", "0::/kubepods/pod1/c1\n", {
        "/sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory\n",
        "/sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "50000 100000\n",
        "/sys/fs/cgroup/kubepods/pod1/cpu.max": "max 100000\n",
    })
    assert [(q.quota_us, q.period_us) for q in cpuquota.cpu_quotas(root=root)] == [(50000, 100000)]
    assert cpuquota.cpu_quota_cores(root=root) == pytest.approx(0.5)
    assert cpuquota.find_cpu_controller(root).version == "v2"


def test_no_quota_and_no_controller(tmp_path):
    unlimited = fake_tree(tmp_path / "a", V1_MOUNT % ("/", "", "cpu"), "1:cpu:/\n", {
        "/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
        "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"})
    assert cpuquota.cpu_quotas(root=unlimited) == []
    assert cpuquota.cpu_quota_cores(root=unlimited) is None
    # A v2 hierarchy without the cpu controller (hybrid hosts, v1 owns cpu) and no v1 cpu.
    bare = fake_tree(tmp_path / "b", V2_MOUNT % "/", "0::/\n",
                     {"/sys/fs/cgroup/cgroup.controllers": "memory pids\n"})
    assert cpuquota.cpu_quotas(root=bare) == []
    with pytest.raises(CpuLimitError, match="neither a cgroup v1 .* nor a cgroup v2"):
        cpuquota.find_cpu_controller(bare)


def test_a_mount_name_that_is_not_utf8_is_read(tmp_path):
    # one such mount anywhere on the host crashed on_train_begin (UnicodeDecodeError)
    root = fake_tree(tmp_path, V1_MOUNT % ("/", "", "cpu"), "1:cpu:/job\n", {
        "/sys/fs/cgroup/cpu/job/cpu.cfs_quota_us": "30000\n",
        "/sys/fs/cgroup/cpu/job/cpu.cfs_period_us": "100000\n"})
    with open(os.path.join(root, "proc/self/mountinfo"), "ab") as f:
        f.write(b"60 23 0:50 / /mnt/cl\xe9 rw - tmpfs revt rw\n")
    assert cpuquota.cpu_quota_cores(root=root) == pytest.approx(0.3)


def test_a_group_outside_the_mounts_view_is_found_by_its_procs_or_not_at_all(tmp_path):
    # A cgroup namespace whose cgroup filesystem was mounted outside it: mountinfo's
    # root reads /.. and /proc/self/cgroup reads /; the group is the one that lists our
    # main thread (v1: in "tasks"; a parent holding another of our threads lists the
    # process in its cgroup.procs, and comes first in the walk)
    pid = os.getpid()
    files = {"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
             "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
             "/sys/fs/cgroup/cpu/cgroup.procs": "1\n%d\n" % pid,
             "/sys/fs/cgroup/cpu/tasks": "1\n%d\n" % (pid + 1),
             "/sys/fs/cgroup/cpu/job/cpu.cfs_quota_us": "30000\n",
             "/sys/fs/cgroup/cpu/job/cpu.cfs_period_us": "100000\n",
             "/sys/fs/cgroup/cpu/job/tasks": "1\n%d\n" % pid,
             "/sys/fs/cgroup/cpu/other/tasks": "%d1\n" % pid}
    root = fake_tree(tmp_path / "ns", V1_MOUNT % ("/..", "", "cpu"), "1:cpu:/\n", files)
    (controller, folder), = cpuquota.cpu_groups(root=root)
    assert folder == os.path.join(root, "sys/fs/cgroup/cpu/job")
    assert cpuquota.cpu_quota_cores(root=root) == pytest.approx(0.3)
    # nothing lists us: not visible (and a path with .. never leaves the mount)
    del files["/sys/fs/cgroup/cpu/job/tasks"]
    for tag, cgroup in (("a", "1:cpu:/\n"), ("b", "1:cpu:/../../x\n")):
        mount_root = "/.." if tag == "a" else "/"
        lost = fake_tree(tmp_path / tag, V1_MOUNT % (mount_root, "", "cpu"), cgroup, files)
        assert [folder for _, folder in cpuquota.cpu_groups(root=lost)] == [None]
        assert cpuquota.cpu_quotas(root=lost) == []
    # a group not found is not searched for again (the callback asks after every
    # adjustment), until /proc/self/cgroup shows the process elsewhere
    (tmp_path / "a/sys/fs/cgroup/cpu/job/tasks").write_text("%d\n" % pid)
    assert cpuquota.cpu_quotas(root=str(tmp_path / "a")) == []
    (tmp_path / "a/proc/self/cgroup").write_text("1:cpu:/job\n")
    assert cpuquota.cpu_quota_cores(root=str(tmp_path / "a")) == pytest.approx(0.3)


def test_quota_group_writes_v1_and_v2_files_and_checks_values(tmp_path):
    for version, mount in (("v1", tmp_path / "v1"), ("v2", tmp_path / "v2")):
        mount.mkdir()
        controller = cpuquota.CpuController(version, str(mount), "/")
        group = QuotaGroup("g", controller, root=str(tmp_path))
        assert group.set_quota(0.3, period_us=10000) == Quota(str(mount / "g"), 3000, 10000)
        if version == "v1":
            assert (mount / "g" / "cpu.cfs_quota_us").read_text() == "3000"
            assert (mount / "g" / "cpu.cfs_period_us").read_text() == "10000"
        else:
            assert (mount / "g" / "cpu.max").read_text() == "3000 10000"
            assert (mount / "cgroup.subtree_control").read_text() == "+cpu"
            group.set_quota(None)
            assert (mount / "g" / "cpu.max").read_text() == "max 10000"
        with pytest.raises(CpuLimitError, match="needs >= 1000 us"):
            group.set_quota(0.05, period_us=10000)
        with pytest.raises(CpuLimitError, match="period_us must be"):
            group.set_quota(0.5, period_us=10)
        for f in (mount / "g").iterdir():   # a real cgroup folder has no removable files
            f.unlink()
        group.close()
        assert not (mount / "g").exists()
        group.close()   # twice is fine
    with pytest.raises(CpuLimitError, match="cgroup name"):
        QuotaGroup("../x", cpuquota.CpuController("v1", str(tmp_path), "/"))


def test_quota_group_close_waits_for_members_still_exiting(tmp_path, monkeypatch):
    # A killed rank can stay in its group for a moment while it exits; it can be
    # neither moved nor removed with it (EBUSY). close() retries until it is gone.
    controller = cpuquota.CpuController("v1", str(tmp_path), "/")
    group = QuotaGroup("g", controller, root=str(tmp_path))
    exits_at = time.monotonic() + 0.3
    monkeypatch.setattr(group, "members",
                        lambda: [4242] if time.monotonic() < exits_at else [])
    real_rmdir = os.rmdir

    def rmdir(path):
        if time.monotonic() < exits_at:
            raise OSError(16, "Device or resource busy")
        real_rmdir(path)

    monkeypatch.setattr(cpulimits.os, "rmdir", rmdir)
    for f in (tmp_path / "g").iterdir():
        f.unlink()
    group.close()
    assert not (tmp_path / "g").exists() and group.closed


def test_remove_stale_groups_keeps_live_owners(tmp_path):
    for name in ("p-1-a", "p-2-a", "other"):
        (tmp_path / name).mkdir()
    controller = cpuquota.CpuController("v1", str(tmp_path), "/")
    assert cpulimits.remove_stale_groups("p-", controller, alive=lambda pid: pid == 2) == ["p-1-a"]
    assert sorted(os.listdir(tmp_path)) == ["other", "p-2-a"]


# ------------------------------------------------------------- on this machine

THREADS = "import threading, time\n" \
          "[threading.Thread(target=time.sleep, args=(60,), daemon=True).start() for _ in range(3)]\n" \
          "print('ready', flush=True); time.sleep(60)\n"


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", THREADS], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_pin_sets_every_thread(child):
    cpu = max(os.sched_getaffinity(0))
    assert cpulimits.pin(child.pid, [cpu]) == 4   # main thread + 3
    for tid in cpulimits.threads(child.pid):
        assert os.sched_getaffinity(tid) == {cpu}
    with pytest.raises(CpuLimitError, match="no CPUs"):
        cpulimits.pin(child.pid, [])


def _real_controller():
    try:
        controller = cpuquota.find_cpu_controller()
    except CpuLimitError as exc:
        pytest.skip(str(exc))
    if os.geteuid() != 0:
        pytest.skip("cgroups need root")
    return controller


def test_real_quota_group_moves_every_thread_and_cleans_up(child):
    controller = _real_controller()
    name = "omnihvd-test-%d" % os.getpid()
    with QuotaGroup(name, controller) as group:
        group.set_quota(0.2, period_us=10000)
        assert group.add(child.pid) == 4
        members = set(group.members())
        if controller.version == "v1":
            assert members == set(cpulimits.threads(child.pid))
        else:
            assert members == {child.pid}
        assert [q.cores for q in cpuquota.cpu_quotas(child.pid)][:1] == [pytest.approx(0.2)]
    assert not os.path.exists(group.path)
    assert cpuquota.cpu_quotas(child.pid) == []


def test_real_quota_throttles_a_busy_process():
    controller = _real_controller()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with QuotaGroup("omnihvd-test-busy-%d" % os.getpid(), controller) as group:
            group.set_quota(0.1, period_us=10000)
            group.add(busy.pid)
            time.sleep(0.5)
            with open("/proc/%d/stat" % busy.pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu0 = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            time.sleep(1.0)
            with open("/proc/%d/stat" % busy.pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            used = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") - cpu0
            # 10% of a core over 1 s is 0.1 s; an unthrottled loop would use ~1 s.
            assert used < 0.4, used
    finally:
        busy.kill()
        busy.wait()
