"""The Slurm templates (slurm/*.sbatch), submitted to a real Slurm cluster.

A module fixture starts a throw-away cluster with tools/slurm_local.py (slurmctld
plus slurmd daemons for the virtual nodes n1, n2 and this host, all in a temporary
folder) and stops it through its pid files afterwards. Each test submits one
template through slurm/submit.sh -- the way a user does, with the shipped site.sh --
polls the job's state with a timeout (``sbatch --wait`` returns late), and reads
the job's log: ranks, world size, nodes, training steps, the balancing decisions.

Slurm missing is a failure, not a skip: ``make test`` installs it first
(``make setup-slurm``, i.e. ``python3 tools/slurm_local.py install``).
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import slurm_local  # noqa: E402  (tools/ is not a package)
from mpirun import run_bounded  # noqa: E402

SUBMIT = os.path.join(ROOT, "slurm", "submit.sh")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
JOB_TIMEOUT = 300  # seconds per job: generous, the machine is shared
GLOBAL_BATCH = 128  # train_job.py's default --global-batch-size
LINE = re.compile(r"omnihvd-job: (.*)$")  # mpirun may prefix "[1,0]<stdout>:"

pytestmark = pytest.mark.cluster


class Cluster:
    """The running local cluster: submit templates, wait for jobs, read their logs."""

    def __init__(self, folder, env):
        self.folder = folder
        self.logs = os.path.join(folder, "logs")
        self.ckpts = os.path.join(folder, "checkpoints")
        self.env = dict(os.environ, **env)
        self.env.update(OMNIHVD_LOG_DIR=self.logs, OMNIHVD_CKPT_DIR=self.ckpts)

    def run(self, *cmd, env=None, check=True):
        proc = subprocess.run(cmd, env=dict(self.env, **(env or {})), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError("%s failed (exit %d):\n%s" % (" ".join(cmd), proc.returncode,
                                                              proc.stdout))
        return proc.stdout

    def submit(self, template, *args, **settings):
        """slurm/submit.sh TEMPLATE ARGS with site settings as environment; the job id."""
        out = self.run(SUBMIT, os.path.join(ROOT, "slurm", template), *map(str, args),
                       env=settings)
        return out.strip().splitlines()[-1].split(";")[0]

    def state(self, job):
        out = self.run("scontrol", "show", "job", "-o", job, check=False)
        m = re.search(r"JobState=(\S+)", out)  # the first record: the hetjob leader
        return m.group(1) if m else "UNKNOWN"

    def log_path(self, job):
        names = [n for n in os.listdir(self.logs) if n.endswith("-%s.out" % job)] \
            if os.path.isdir(self.logs) else []
        return os.path.join(self.logs, names[0]) if names else None

    def log(self, job):
        path = self.log_path(job)
        if path is None:
            return ""
        with open(path, errors="replace") as f:
            return f.read()

    def wait(self, job, timeout=JOB_TIMEOUT):
        """Poll until the job ends; cancel it and fail if it takes longer than timeout."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state(job)
            if state in TERMINAL:
                return state
            if time.monotonic() > deadline:
                where = srun_threads()   # before scancel: where a hung srun waits
                self.run("scancel", job, check=False)
                kill_job_sruns(job)      # a hung srun outlives scancel
                raise AssertionError("job %s still %s after %d s; log:\n%s\n%s\n%s" % (
                    job, state, timeout, self.log(job), slurm_local._log_tails(self.folder),
                    where))
            time.sleep(0.5)

    def wait_for_line(self, job, pattern, timeout=JOB_TIMEOUT):
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.log(job), re.M):
            state = self.state(job)
            if state in TERMINAL or time.monotonic() > deadline:
                raise AssertionError("job %s (%s) never printed %r; log:\n%s"
                                     % (job, state, pattern, self.log(job)))
            time.sleep(0.3)

    def completed(self, job, timeout=JOB_TIMEOUT):
        """Wait for the job; assert it COMPLETED; return its log."""
        state = self.wait(job, timeout)
        log = self.log(job)
        assert state == "COMPLETED", "job %s ended %s; log:\n%s" % (job, state, log)
        return log


def srun_threads() -> str:
    """Every srun process's threads and what each waits in (the kernel's wchan), plus
    gdb's backtrace where gdb is installed: the evidence of an srun that hangs after
    its tasks have ended (Slurm 22.05's het steps, docs/slurm.rst)."""
    out = []
    for pid in srun_pids():
        try:
            threads = sorted(os.listdir("/proc/%s/task" % pid), key=int)
            waits = []
            for tid in threads:
                with open("/proc/%s/task/%s/wchan" % (pid, tid)) as f:
                    waits.append("%s:%s" % (tid, f.read().strip() or "-"))
        except OSError:
            continue
        out.append("--- srun %s threads (tid:wchan): %s" % (pid, " ".join(waits)))
        if shutil.which("gdb"):
            try:
                bt = subprocess.run(["gdb", "-p", pid, "-batch", "-ex", "thread apply all bt"],
                                    capture_output=True, text=True, timeout=120)
                out.append(bt.stdout[-8000:])
            except subprocess.TimeoutExpired:
                out.append("(gdb took more than 120 s)")
    return "\n".join(out) or "--- no srun process"


def srun_pids():
    """Pids (strings) of this machine's processes named srun (a script named srun too:
    the kernel names a process after the file it executed)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/%s/comm" % pid) as f:
                if f.read().strip() == "srun":
                    yield pid
        except OSError:
            continue


def srun_environ(pid):
    """The environment entries (bytes) of process ``pid``; empty once it is gone."""
    try:
        with open("/proc/%s/environ" % pid, "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def kill_job_sruns(job):
    """SIGKILL every srun of ``job`` (found by SLURM_JOB_ID in its environment); the
    pids killed."""
    killed = []
    for pid in srun_pids():
        if ("SLURM_JOB_ID=%s" % job).encode() in srun_environ(pid):
            try:
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
            except OSError:
                continue
    return killed


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("slurm"))
    env = slurm_local.start(folder)  # raises (the test fails) when Slurm is missing
    try:
        yield Cluster(folder, env)
    finally:
        slurm_local.stop(folder)


def job_lines(log):
    return [m.group(1) for m in map(LINE.search, log.splitlines()) if m]


def parse(log):
    """The log's rank lines ({rank: (size, node, restart)}) and rank 0's result dict."""
    ranks, result = {}, None
    for line in job_lines(log):
        m = re.match(r"rank=(\d+) size=(\d+) node=(\S+) restart=(\d+)", line)
        if m:
            ranks[int(m.group(1))] = (int(m.group(2)), m.group(3), int(m.group(4)))
        elif line.startswith("result "):
            result = json.loads(line[len("result "):])
    assert result is not None, "no result line in the log:\n" + log
    return ranks, result


def check_training(log, world_size, steps, nodes=None):
    """Every rank reported, one world, the steps ran, loss fell, sizes sum to B."""
    ranks, result = parse(log)
    assert sorted(ranks) == list(range(world_size)), log
    assert {size for size, _, _ in ranks.values()} == {world_size}, log
    assert result["world_size"] == world_size and result["steps"] == steps, result
    assert len(result["batch_sizes"]) == world_size, result
    assert sum(result["batch_sizes"]) == GLOBAL_BATCH, result
    assert result["last_loss"] < result["first_loss"], result
    decisions = [line for line in job_lines(log) if line.startswith("decision ")]
    assert len(decisions) == result["decisions"], log
    if nodes is not None:
        assert result["nodes"] == nodes, (result, log)
    return ranks, result


def test_single_node_srun(cluster):
    job = cluster.submit("single_node.sbatch", "--steps", 15)
    log = cluster.completed(job)
    assert "style=srun" in log
    check_training(log, world_size=4, steps=15, nodes=["n1"] * 4)


def test_multi_node_srun(cluster):
    job = cluster.submit("multi_node_srun.sbatch", "--steps", 15)
    log = cluster.completed(job)
    check_training(log, world_size=4, steps=15, nodes=["n1", "n1", "n2", "n2"])


def test_multi_node_mpirun_reads_the_allocation(cluster):
    job = cluster.submit("multi_node_mpirun.sbatch", "--steps", 15)
    log = cluster.completed(job)
    assert "style=mpirun" in log
    check_training(log, world_size=4, steps=15, nodes=["n1", "n1", "n2", "n2"])


def test_horovodrun_with_hosts_from_the_allocation(cluster):
    # horovodrun needs host names it can resolve (and ssh between nodes): on this
    # cluster that is the node named after this host, in partition "host".
    host = slurm_local.node_names()[2]
    job = cluster.submit("multi_node_horovodrun.sbatch", "--steps", 15,
                         OMNIHVD_PARTITION="host",
                         OMNIHVD_SBATCH_OPTS="--nodes=1 --ntasks-per-node=4")
    log = cluster.completed(job)
    assert "horovodrun -H %s:4 " % host in log
    check_training(log, world_size=4, steps=15, nodes=[host] * 4)


@pytest.mark.parametrize("nodelist, tasks, expected", [
    ("n[1-2]", "2(x2)", "n1:2,n2:2"),
    ("a[1-3],b7", "3(x2),1,4", "a1:3,a2:3,a3:1,b7:4"),
    ("n1", "4", "n1:4"),
])
def test_horovod_host_list(cluster, nodelist, tasks, expected):
    # The multi-node -H list, from Slurm's compressed variables (no job needed).
    script = ('source "%s/slurm/common.sh" && SLURM_JOB_NODELIST="%s" SLURM_TASKS_PER_NODE="%s" '
              'omnihvd_horovod_hosts' % (ROOT, nodelist, tasks))
    assert cluster.run("bash", "-c", script).strip().splitlines()[-1] == expected


def test_hetjob_one_world_over_two_node_types_balances(cluster):
    # Node n2 (partition "slow") emulates hardware three times slower.
    job = cluster.submit("hetjob.sbatch", "--steps", 25, "--ms-per-sample", 1,
                         "--slow-nodes", "n2", "--slowdown", 3,
                         OMNIHVD_HET_PARTITIONS="fast slow")
    log = cluster.completed(job)
    assert "component 0: fast n1; component 1: slow n2" in log, log
    _, result = check_training(log, world_size=4, steps=25, nodes=["n1", "n1", "n2", "n2"])
    assert result["decisions"] >= 1, log
    fast, slow = result["sizes_by_node"]["n1"], result["sizes_by_node"]["n2"]
    assert max(slow) < min(fast), "the slow node type kept as much work: %s\n%s" % (result, log)


def test_torchrun_ddp_over_two_nodes(cluster):
    # One torchrun per node (srun), two ranks each, a c10d rendezvous on the first
    # node: one world of 4 training with DDPOmniLearnCallback (no Horovod, no MPI).
    job = cluster.submit("torchrun.sbatch", "--steps", 12, "--global-batch-size", 64,
                         "--epochs", 2)
    log = cluster.completed(job)
    assert "style=torchrun" in log and re.search(r"rendezvous \S+:\d+, 2 nodes x 2 ranks", log), log
    epochs = re.findall(r"^epoch (\d): .* batch sizes (\[[\d, ]+\])", log, re.M)
    assert [e for e, _ in epochs] == ["0", "1"], log
    for _, sizes in epochs:
        sizes = json.loads(sizes)
        assert len(sizes) == 4 and sum(sizes) == 64, log


@pytest.mark.parametrize("nodelist", ["n[1-2]", "n2,n1"])
def test_torchrun_master_addr_is_the_first_node(cluster, nodelist):
    # The rendezvous host: the first node of the list, by Slurm's address for it.
    script = 'source "%s/slurm/common.sh" && SLURM_JOB_NODELIST="%s" omnihvd_master_addr' % (
        ROOT, nodelist)
    first = "n1" if nodelist.startswith("n[") else "n2"
    addr = re.search(r"NodeAddr=(\S+)", cluster.run("scontrol", "show", "node", first)).group(1)
    assert cluster.run("bash", "-c", script).strip().splitlines()[-1] == addr


def test_checkpoint_on_signal_requeue_and_resume(cluster):
    # Rank 1 emulates a slower device, so the sizes are unequal when the job is
    # signalled, and the resumed run must restore them, not restart from 64/64.
    steps = 40
    job = cluster.submit("checkpoint_requeue.sbatch", "--steps", steps, "--step-sleep", 0.1,
                         "--ms-per-sample", 1, "--slow-ranks", 1)
    cluster.wait_for_line(job, r"omnihvd-job: step=10 ")
    # What --signal=USR1@T does T seconds before the time limit: USR1 to every task.
    cluster.run("scancel", "--signal=USR1", job)
    log = cluster.completed(job)

    lines = job_lines(log)
    saved = [re.match(r"checkpoint step=(\d+) batch_sizes=(\[.*?\]) epoch=(\d+)", s) for s in lines]
    saved = [m for m in saved if m]
    resumed = [m for m in (re.match(r"resumed step=(\d+) batch_sizes=(\[.*?\]) epoch=(\d+)", s)
                           for s in lines) if m]
    assert len(saved) == 1 and len(resumed) == 1, log
    assert saved[0].groups() == resumed[0].groups(), log  # step, sizes, epoch restored
    step, sizes = int(saved[0].group(1)), json.loads(saved[0].group(2))
    assert 10 <= step < steps and sizes != [64, 64], log
    assert "requeueing job %s" % job in log and "restart=1" in log, log
    ranks, result = check_training(log, world_size=2, steps=steps, nodes=["n1", "n1"])
    assert result["restart"] == 1 and result["resumed_from"] == step, result
    assert {restart for _, _, restart in ranks.values()} == {1}, log
    assert "Restarts=1" in cluster.run("scontrol", "show", "job", job)
    ckpt = [n for n in os.listdir(cluster.ckpts) if n.endswith("-%s.pt" % job)]
    assert ckpt, os.listdir(cluster.ckpts)


def test_submit_without_template_explains_usage(cluster):
    proc = subprocess.run([SUBMIT], env=cluster.env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=30)
    assert proc.returncode == 2 and "usage:" in proc.stdout


def test_every_srun_launch_kills_the_job_on_a_bad_exit():
    # Without --kill-on-bad-exit=1 a rank that dies leaves the others waiting in a
    # collective until the job's time limit; with it Slurm ends the whole step.
    # A static check of the templates: it needs no cluster.
    launches = srun_launches()
    assert len(launches) >= 4, launches
    for name, line in launches:
        if name == "checkpoint_requeue.sbatch":
            # its ranks all exit 85 (requeue me) on purpose: there the flag would SIGTERM
            # the ranks still exiting and turn 85 into 143 (the template says so)
            assert "--kill-on-bad-exit" not in line, line
            continue
        for component in line.split(" : "):  # each component of a heterogeneous step
            assert "--kill-on-bad-exit=1" in component.split('"')[0], (name, component)


def srun_launches():
    """(template, srun command) for every srun line of slurm/*.sbatch, continuations
    joined; hetjob.sbatch launches through omnihvd_het_srun, srun's bounded wait."""
    launches = []
    for name in sorted(os.listdir(os.path.join(ROOT, "slurm"))):
        if name.endswith(".sbatch"):
            with open(os.path.join(ROOT, "slurm", name)) as f:
                text = f.read().replace("\\\n", " ")
            launches += [(name, " ".join(line.split())) for line in text.splitlines()
                         if line.startswith(("srun ", "omnihvd_het_srun "))]
    return launches


def test_hetjob_runs_every_task_under_the_status_wrapper():
    # omnihvd_het_srun can bound srun's wait only if every task leaves its status
    # (slurm/common.sh): both components run the same wrapped training command.
    (line,) = [line for name, line in srun_launches() if name == "hetjob.sbatch"]
    assert line.startswith("omnihvd_het_srun "), line
    first, second = line.split(" : ")
    assert "--het-group=0" in first and "--het-group=1" in second, line
    for component in (first, second):
        assert '"${TASK[@]}" "${TRAIN[@]}" "$@"' in component, line


FAKE_SRUN = """#!%s
# A stand-in for srun: runs each ":"-separated component's command (its leading
# options dropped) as tasks 0, 1, ... with SLURM_PROCID and SLURM_NTASKS, waits for
# them, then hangs (FAKE_SRUN_THEN=hang, Slurm 22.05's het-step srun now and then)
# or, after FAKE_SRUN_DELAY seconds, exits with the status FAKE_SRUN_THEN.
import os, subprocess, sys, time
components, current = [], []
for arg in sys.argv[1:]:
    if arg == ":":
        components.append(current)
        current = []
    else:
        current.append(arg)
components.append(current)
tasks = []
for rank, command in enumerate(components):
    while command and command[0].startswith("--"):
        command.pop(0)
    env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_NTASKS=str(len(components)))
    tasks.append(subprocess.Popen(command, env=env))
for task in tasks:
    task.wait()
if os.environ["FAKE_SRUN_THEN"] == "hang":
    time.sleep(600)
time.sleep(float(os.environ.get("FAKE_SRUN_DELAY", "0")))
sys.exit(int(os.environ["FAKE_SRUN_THEN"]))
"""


def het_srun(tmp_path, then, statuses, wrapped=True, grace=2, delay=0):
    """omnihvd_het_srun over a fake srun whose tasks exit with ``statuses``; the
    output and the seconds it took."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN % sys.executable)
    (bin_dir / "srun").chmod(0o755)
    task = '"${TASK[@]}" ' if wrapped else ""
    components = " : ".join("--het-group=%d %sbash -c 'exit %d'" % (i, task, s)
                            for i, s in enumerate(statuses))
    script = ('source "%s/slurm/common.sh" && TASK=(bash -c "$(omnihvd_het_task)" t) && '
              'omnihvd_het_srun %s; echo "status=$?"' % (ROOT, components))
    env = dict(os.environ, PATH="%s:%s" % (bin_dir, os.environ["PATH"]),
               OMNIHVD_HET_STATUS_DIR=str(tmp_path / "status"), OMNIHVD_HET_SRUN_GRACE=str(grace),
               FAKE_SRUN_THEN=str(then), FAKE_SRUN_DELAY=str(delay))
    start = time.monotonic()
    proc = run_bounded(["bash", "-c", script], 120, env)  # a hang fails, leaving nothing
    return proc.stdout, time.monotonic() - start


def test_het_srun_kills_an_srun_that_hangs_after_every_task_exited(tmp_path):
    out, took = het_srun(tmp_path, "hang", [0, 3])
    assert out.strip().endswith("status=3"), out   # the highest task status, as srun's
    assert "killed it; highest task status 3" in out, out
    assert took < 60, took   # the 600 s hang was cut short (2 s grace)
    mine = ("OMNIHVD_HET_STATUS_DIR=%s" % (tmp_path / "status")).encode()
    assert not [p for p in srun_pids() if mine in srun_environ(p)], "the fake srun survived"
    assert not os.path.exists(tmp_path / "status")


@pytest.mark.parametrize("status", [0, 7])
def test_het_srun_returns_srun_own_status_when_it_returns(tmp_path, status):
    # srun returning within the grace (1 s after its tasks, of 3) is never cut short
    out, _ = het_srun(tmp_path, status, [0, status], grace=3, delay=1)
    assert out.strip().endswith("status=%d" % status) and "killed" not in out, out


@pytest.mark.parametrize("grace", ["2.5", "-1", "30s"])
def test_het_srun_refuses_a_grace_that_is_not_whole_seconds(tmp_path, grace):
    # before srun starts: a bad value must not turn into a bound of 0 s
    out, _ = het_srun(tmp_path, 0, [0, 0], grace=grace)
    assert out.strip().endswith("status=2"), out
    assert "must be whole seconds (0: no bound), not '%s'" % grace in out, out
    assert not (tmp_path / "status").exists(), "srun ran"


def test_het_srun_waits_without_a_bound_for_tasks_that_left_no_status(tmp_path):
    # tasks not under the wrapper (or killed before writing): srun decides, however
    # long it takes after its tasks (here 4 s, past the 1 s grace)
    out, took = het_srun(tmp_path, 5, [0, 0], wrapped=False, grace=1, delay=4)
    assert out.strip().endswith("status=5") and "killed" not in out, out
    assert took >= 4, took


def test_het_task_keeps_the_status_survives_signals_and_leaves_it(tmp_path):
    # A USR1 to the task (Slurm signals every process of it) reaches the training
    # script and does not kill the wrapper, which records the script's status.
    script = ('trap : USR1; source "%s/slurm/common.sh" && '
              'bash -c "$(omnihvd_het_task)" task bash -c \''
              'trap "echo got-usr1" USR1; sleep 0.6 & wait; exit 7\'' % ROOT)
    env = dict(os.environ, OMNIHVD_HET_STATUS_DIR=str(tmp_path), SLURM_PROCID="3",
               SLURM_NTASKS="4")
    proc = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGUSR1)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 7, (proc.returncode, out)
    assert "got-usr1" in out, out
    assert (tmp_path / "task.3").read_text().split() == ["7", "4"]


def test_srun_threads_names_every_thread_of_a_waiting_srun(tmp_path):
    """What a timed-out job's report adds: each srun thread and its kernel wait."""
    fake = tmp_path / "srun"
    shutil.copy(shutil.which("sleep"), fake)
    proc = subprocess.Popen([str(fake), "60"])
    try:
        deadline = time.monotonic() + 10
        while "srun %d " % proc.pid not in srun_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        report = srun_threads()
        assert "--- srun %d threads (tid:wchan): %d:" % (proc.pid, proc.pid) in report, report
    finally:
        proc.kill()
        proc.wait()
    assert "srun %d " % proc.pid not in srun_threads()


def test_kill_job_sruns_kills_only_that_jobs_srun(tmp_path):
    fake = tmp_path / "srun"
    shutil.copy(shutil.which("sleep"), fake)
    ours = subprocess.Popen([str(fake), "60"], env=dict(os.environ, SLURM_JOB_ID="4242"))
    other = subprocess.Popen([str(fake), "60"], env=dict(os.environ, SLURM_JOB_ID="42420"))
    try:
        time.sleep(0.2)
        assert kill_job_sruns("4242") == [ours.pid]
        assert ours.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait()


def test_a_failing_site_setup_ends_the_job_with_a_clear_message(tmp_path):
    # OMNIHVD_ROOT without a .venv: site.sh's activate fails, and the job stops there
    # instead of launching ranks on whichever python is on PATH.
    proc = subprocess.run(["bash", "-c", 'source "%s/slurm/common.sh"; echo LAUNCHED' % ROOT],
                          env=dict(os.environ, OMNIHVD_ROOT=str(tmp_path)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "LAUNCHED" not in proc.stdout, proc
    assert "omnihvd_site_env failed" in proc.stderr, proc.stderr


def test_a_refused_requeue_fails_the_job_and_keeps_the_checkpoint(tmp_path):
    # --no-requeue (or a site that disables requeues): the job stopped part-way; it
    # ended COMPLETED with exit 0 before
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 'Requested operation is presently "
                                      "disabled' >&2\nexit 1\n")
    (bin_dir / "scontrol").chmod(0o755)
    proc = subprocess.run(["bash", "-c", 'source "%s/slurm/common.sh" && omnihvd_finish 85' % ROOT],
                          env=dict(os.environ, PATH="%s:%s" % (bin_dir, os.environ["PATH"]),
                                   SLURM_JOB_ID="13"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 85, proc
    assert "refused to requeue job 13" in proc.stderr and "resubmit" in proc.stderr, proc.stderr


def test_the_job_environment_reaches_the_tasks_and_srun_gets_the_cpus():
    # SBATCH_EXPORT=NONE leaves SLURM_EXPORT_ENV=NONE in the batch shell: srun would
    # start the tasks without the site's environment (python not found)
    script = ('source "%s/slurm/common.sh" && echo "$SLURM_EXPORT_ENV $SRUN_CPUS_PER_TASK '
              '$OMP_NUM_THREADS"' % ROOT)
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, SLURM_EXPORT_ENV="NONE", SLURM_CPUS_PER_TASK="3"))
    assert proc.stdout.split() == ["ALL", "3", "3"], proc


def test_het_srun_reads_a_grace_with_a_leading_zero_as_decimal(tmp_path):
    # "08" passed the whole-seconds check, then failed as an octal number: the bound
    # was off and the hung srun was waited for until the test's limit
    out, took = het_srun(tmp_path, "hang", [0, 3], grace="08")
    assert out.strip().endswith("status=3") and "srun had not returned 8 s" in out, out
    assert 8 <= took < 60, took


def test_a_first_run_ignores_a_checkpoint_it_did_not_write(tmp_path):
    # a fresh slurmctld gives job ids out again: job 7's checkpoint is not this job 7's
    stale = tmp_path / "omnihvd-ckpt-7.pt"
    stale.write_text("not this job's")
    env = dict(os.environ, SLURM_JOB_ID="7", SLURM_RESTART_COUNT="0",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = run_bounded(["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none",
                        sys.executable, os.path.join(ROOT, "slurm", "train_job.py"),
                        "--steps", "4", "--checkpoint", str(stale)], 120, env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "ignoring %s: this job was not requeued" % stale in proc.stdout, proc.stdout[-3000:]
    result = json.loads(proc.stdout.split("omnihvd-job: result ")[1].splitlines()[0])
    assert result["steps"] == 4 and result["resumed_from"] is None, result
    # --resume (after a refused requeue) is asked for: a file missing is an error
    proc = run_bounded(["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none",
                        sys.executable, os.path.join(ROOT, "slurm", "train_job.py"),
                        "--steps", "4", "--resume", str(tmp_path / "gone.pt")], 120, env)
    assert proc.returncode != 0 and "--resume %s: no such file" % (tmp_path / "gone.pt") \
        in proc.stdout, proc.stdout[-3000:]
