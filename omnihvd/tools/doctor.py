"""``omnihvd doctor``: check that torch, horovod, MPI and mpi4py work together.

Broken installs are the most common trouble with Horovod: horovod built against
another torch, built without MPI, an MPI without thread support, mpi4py and horovod
loading two different MPI libraries, or an ``mpirun`` from another MPI than the one
the processes link. Each of these is one line here, with its fix::

    $ omnihvd doctor
    omnihvd doctor: omnihvd 0.1.0, Python 3.11.2 (/work/main/.venv/bin/python)
      OK    torch            2.13.0+cpu
      OK    horovod build    PyTorch extension loads; built with MPI, Gloo
      ...

Everything that imports torch, horovod or mpi4py (and so initialises MPI) runs in a
child process with a time limit, so the doctor itself cannot crash or hang, and it
works outside ``mpirun``: the child starts MPI as a single process (a singleton).
The exit status is 1 when a check FAILs (something needed is broken), else 0;
WARNs do not fail.

This module imports only the standard library, so it works when everything else
is broken.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from typing import Dict, List, NamedTuple, Optional

__all__ = ["Check", "run_checks", "configure_parser", "run", "core_mpi_libs", "mpi_family"]

OK, WARN, FAIL, SKIP = "OK", "WARN", "FAIL", "SKIP"
HOROVOD_VERSION = "0.28.1"
MIN_TORCH = (2, 1)
SETUP = "bash tools/setup.sh"
DATA_DIR = "/usr/share/datasets/fashion-mnist"
DATA_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
              "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")  # each .gz or plain
_MARK = "OMNIHVD-PROBE "
# The MPI library itself, not its C++/Fortran bindings (libmpi_cxx, libmpi_mpifh...).
_CORE_MPI = re.compile(r"^lib(mpi|mpich)(_cray|_ibm|_mt|_dbg)?\.so(\.|$)")
_THREAD_LEVELS = {0: "MPI_THREAD_SINGLE", 1: "MPI_THREAD_FUNNELED",
                  2: "MPI_THREAD_SERIALIZED", 3: "MPI_THREAD_MULTIPLE"}


class Check(NamedTuple):
    """The result of one check.

    Attributes:
        name: short label, e.g. ``"horovod build"``.
        status: ``"OK"``, ``"WARN"`` (works, but worth knowing), ``"FAIL"`` (needed
            and broken) or ``"SKIP"`` (not checked because a check it needs FAILed).
        detail: what was found.
        fix: what to do about a WARN or FAIL ("" for OK).
    """
    name: str
    status: str
    detail: str
    fix: str = ""


# --------------------------------------------------------------------------- helpers

def core_mpi_libs(maps_text: str) -> List[str]:
    """The MPI libraries mapped into a process, from its ``/proc/<pid>/maps`` text.

    Args:
        maps_text: contents of a ``/proc/<pid>/maps`` file.

    Returns:
        Sorted real paths of the core MPI libraries (``libmpi.so*``, ``libmpich.so*``,
        ``libmpi_cray.so*``...), without language bindings such as ``libmpi_cxx``.

    Example:
        >>> core_mpi_libs("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libmpi.so.40.30.4\\n")
        ['/usr/lib/libmpi.so.40.30.4']
    """
    found = set()
    for line in maps_text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            path = parts[5].strip()
            if _CORE_MPI.match(os.path.basename(path)):
                found.add(os.path.realpath(path) if os.path.exists(path) else path)
    return sorted(found)


def mpi_family(text: str) -> Optional[str]:
    """The ABI family of an MPI, from ``mpirun --version`` or ``MPI_Get_library_version``.

    Processes and launcher must come from the same family: an Open MPI program started
    by an MPICH ``mpirun`` runs as n separate singletons of size 1.

    Args:
        text: the version text.

    Returns:
        ``"Open MPI"`` (Open MPI, IBM Spectrum MPI), ``"MPICH"`` (MPICH, MVAPICH,
        Intel MPI, Cray MPICH: one ABI), or None when the text is not recognised.

    Example:
        >>> mpi_family("mpirun (Open MPI) 4.1.4")
        'Open MPI'
    """
    low = (text or "").lower()
    if "open mpi" in low or "openrte" in low or "spectrum mpi" in low:
        return "Open MPI"
    if any(word in low for word in ("mpich", "hydra", "mvapich", "intel(r) mpi")):
        return "MPICH"
    return None


def _version_tuple(text: str):
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return tuple(int(g) for g in match.groups() if g is not None) if match else None


def _first_line(text: str) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


def _short_error(exc: BaseException) -> str:
    text = "%s: %s" % (type(exc).__name__, exc)
    return text if len(text) <= 400 else text[:397] + "..."


# --------------------------------------------------------------------------- child

def _probe_main() -> None:
    """Run in the child process: import everything, initialise MPI, report facts.

    Each fact is printed as soon as it is known (one ``OMNIHVD-PROBE {json}`` line),
    so a crash half-way still leaves the facts gathered before it.
    """
    def report(key, value):
        sys.stdout.write("\n%s%s\n" % (_MARK, json.dumps({key: value})))
        sys.stdout.flush()

    def maps():
        try:
            with open("/proc/self/maps") as f:
                return core_mpi_libs(f.read())
        except OSError:
            return None

    torch = hvd = None
    report("step", "import torch")
    try:
        import torch
        report("torch", {"version": torch.__version__,
                         "cuda_available": bool(torch.cuda.is_available()),
                         "cuda_devices": int(torch.cuda.device_count()),
                         "cuda_version": torch.version.cuda})
    except BaseException as e:  # noqa: BLE001 - any failure is a finding
        report("torch", {"error": _short_error(e)})
    report("step", "import horovod")
    try:
        import horovod
        report("horovod", {"version": getattr(horovod, "__version__", "unknown"),
                           "path": os.path.dirname(os.path.abspath(horovod.__file__))})
    except BaseException as e:  # noqa: BLE001
        report("horovod", {"error": _short_error(e)})
    else:
        report("step", "import horovod.torch")
        try:
            import horovod.torch as hvd
            report("horovod_torch", {"mpi_built": bool(hvd.mpi_built()),
                                     "gloo_built": bool(hvd.gloo_built()),
                                     "nccl_built": int(hvd.nccl_built()),
                                     "cuda_built": bool(hvd.cuda_built()),
                                     "libmpi": maps()})
        except BaseException as e:  # noqa: BLE001
            hvd = None
            report("horovod_torch", {"error": _short_error(e)})
    report("step", "import mpi4py.MPI (MPI_Init)")
    try:
        import mpi4py
        before = maps()
        from mpi4py import MPI  # initialises MPI (as a singleton outside mpirun)
        after = maps()
        # MPI4PY_RC_THREAD_LEVEL overrides mpi4py.rc when MPI is initialised.
        rc_level = (os.environ.get("MPI4PY_RC_THREAD_LEVEL")
                    or getattr(mpi4py.rc, "thread_level", None))
        report("mpi4py", {
            "version": mpi4py.__version__, "rc_thread_level": rc_level,
            "library_version": _first_line(MPI.Get_library_version()),
            "mpi_version": "%d.%d" % MPI.Get_version(),
            "thread_provided": int(MPI.Query_thread()),
            "thread_multiple": int(MPI.THREAD_MULTIPLE),
            "libmpi": after,
            "libmpi_added": None if after is None else sorted(set(after) - set(before or ())),
        })
    except BaseException as e:  # noqa: BLE001
        report("mpi4py", {"error": _short_error(e)})
    if hvd is not None and torch is not None:
        report("step", "hvd.init() and hvd.allreduce")
        try:
            hvd.init()
            x = torch.arange(4, dtype=torch.float32)
            summed = hvd.allreduce(x, op=hvd.Sum, name="omnihvd_doctor")
            facts = {"size": int(hvd.size()), "mpi_enabled": bool(hvd.mpi_enabled()),
                     "allreduce_ok": bool(torch.equal(summed, x * hvd.size()))}
            facts["mpi_threads_supported"] = (bool(hvd.mpi_threads_supported())
                                              if facts["mpi_enabled"] else None)
            hvd.shutdown()
            report("horovod_init", facts)
        except BaseException as e:  # noqa: BLE001
            report("horovod_init", {"error": _short_error(e)})
    report("done", True)


def probe(timeout: float = 60.0) -> Dict:
    """Run :func:`_probe_main` in a child process with a time limit.

    The child is started as ``python -c`` with this file run by path, so it depends
    neither on the ``omnihvd`` package's imports nor on the current directory.

    Args:
        timeout: seconds before the child (and anything it started) is killed.

    Returns:
        dict of facts (keys ``torch``, ``horovod``, ``horovod_torch``, ``mpi4py``,
        ``horovod_init``, ``done``, each present when that step reported), plus
        ``"child"``: ``{"returncode", "timed_out", "output_tail"}``.
    """
    # Drop the current folder that `python -c` puts first on sys.path (absent under -P).
    code = ("import os, runpy, sys; "
            "sys.path[:1] = [p for p in sys.path[:1] if p not in ('', os.getcwd())]; "
            "runpy.run_path(sys.argv[1])['_probe_main']()")
    proc = subprocess.Popen([sys.executable, "-c", code, os.path.abspath(__file__)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        out, _ = proc.communicate()
    text = out.decode("utf-8", "replace")
    facts, other = {}, []
    for line in text.splitlines():
        at = line.find(_MARK)
        if at >= 0:
            try:
                facts.update(json.loads(line[at + len(_MARK):]))
                continue
            except ValueError:
                pass
        if line.strip():
            other.append(line)
    facts["child"] = {"returncode": proc.returncode, "timed_out": timed_out,
                      "output_tail": "\n".join(other[-15:])}
    return facts


# --------------------------------------------------------------------------- checks

def _not_reached(name) -> Check:
    return Check(name, SKIP, "not checked: the check process stopped first (see below)")


def _check_torch(facts) -> Check:
    t = facts.get("torch")
    if t is None:
        return _not_reached("torch")
    if "error" in t:
        return Check("torch", FAIL, t["error"],
                     "install torch >= %d.%d: %s (or OMNIHVD_TORCH=keep to use the base "
                     "python's torch)" % (MIN_TORCH + (SETUP,)))
    v = _version_tuple(t["version"])
    if v is None or v[:2] < MIN_TORCH:
        return Check("torch", FAIL, "%s is older than %d.%d" % ((t["version"],) + MIN_TORCH),
                     "upgrade torch (>= %d.%d), then rerun %s: it rebuilds horovod for it"
                     % (MIN_TORCH + (SETUP,)))
    return Check("torch", OK, t["version"])


def _gpu_hardware() -> bool:
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


def _check_cuda(facts) -> Check:
    t = facts.get("torch")
    if t is None:
        return _not_reached("CUDA")
    if "error" in t:
        return Check("CUDA", SKIP, "needs torch")
    if not t["cuda_available"]:
        if _gpu_hardware():
            return Check("CUDA", WARN, "an NVIDIA GPU is present but torch %s cannot use it"
                         % t["version"],
                         "install a CUDA build of torch in the base python, remove .venv, "
                         "and run OMNIHVD_TORCH=keep %s" % SETUP)
        return Check("CUDA", OK, "not visible: CPU only")
    detail = "%d GPU(s) visible, CUDA %s" % (t["cuda_devices"], t["cuda_version"])
    ht = facts.get("horovod_torch") or {}
    if "error" not in ht and ht and not ht.get("nccl_built"):
        return Check("CUDA", WARN, detail + "; horovod has no NCCL/GPU support",
                     "pass CPU tensors to horovod, or rebuild it with "
                     "HOROVOD_GPU_OPERATIONS=NCCL (see docs/installation.rst)")
    return Check("CUDA", OK, detail)


def _check_horovod(facts) -> Check:
    h = facts.get("horovod")
    if h is None:
        return _not_reached("horovod")
    if "error" in h:
        return Check("horovod", FAIL, h["error"],
                     "%s (builds horovod %s with PyTorch + MPI; a plain `pip install "
                     "horovod` fails against torch >= 2.1)" % (SETUP, HOROVOD_VERSION))
    detail = "%s (%s)" % (h["version"], h["path"])
    if h["version"] != HOROVOD_VERSION:
        return Check("horovod", WARN, detail + ", expected %s" % HOROVOD_VERSION,
                     "omnihvd is tested with horovod %s: pip uninstall horovod, then %s"
                     % (HOROVOD_VERSION, SETUP))
    return Check("horovod", OK, detail)


def _check_horovod_build(facts) -> Check:
    h, ht = facts.get("horovod"), facts.get("horovod_torch")
    if h is None:
        return _not_reached("horovod build")
    if "error" in h:
        return Check("horovod build", SKIP, "needs horovod")
    if ht is None:
        return _not_reached("horovod build")
    if "error" in ht:
        err = ht["error"]
        if "undefined symbol" in err:
            fix = ("horovod was built against another torch: %s rebuilds it for the "
                   "torch now installed" % SETUP)
        elif "libmpi" in err or "libmpich" in err:
            fix = ("the MPI horovod was built with is not found: load that MPI (module "
                   "load ...) or add its lib folder to LD_LIBRARY_PATH; or rerun %s" % SETUP)
        else:
            fix = ("rebuild horovod with PyTorch: %s (HOROVOD_WITH_PYTORCH=1 and the "
                   "C++17 wrapper)" % SETUP)
        return Check("horovod build", FAIL, "horovod.torch does not load: " + err, fix)
    built = ["MPI"] if ht["mpi_built"] else []
    built += ["Gloo"] if ht["gloo_built"] else []
    built += ["NCCL %s" % ht["nccl_built"]] if ht["nccl_built"] else []
    built += ["CUDA"] if ht["cuda_built"] else []
    detail = "PyTorch extension loads; built with " + (", ".join(built) or "nothing")
    if not ht["mpi_built"]:
        return Check("horovod build", FAIL, detail + " (no MPI)",
                     "pip uninstall horovod, then %s (builds with HOROVOD_WITH_MPI=1)" % SETUP)
    if not ht["gloo_built"]:
        return Check("horovod build", WARN, detail + " (no Gloo: no horovodrun --gloo, "
                     "no elastic mode)", "rebuild with HOROVOD_WITH_GLOO=1: %s" % SETUP)
    return Check("horovod build", OK, detail)


def _check_mpi4py(facts) -> Check:
    m = facts.get("mpi4py")
    if m is None:
        return _not_reached("mpi4py")
    if "error" in m:
        return Check("mpi4py", FAIL, m["error"],
                     "install mpi4py (.venv/bin/pip install mpi4py, or %s); with a cluster "
                     "MPI, build it against that MPI: pip install --no-binary mpi4py "
                     "--force-reinstall mpi4py" % SETUP)
    library = m["library_version"].split(",")[0]  # "Open MPI v4.1.4, package: ..."
    return Check("mpi4py", OK, "%s on %s (MPI %s)" % (m["version"], library, m["mpi_version"]))


def _check_threads(facts) -> Check:
    m = facts.get("mpi4py")
    if m is None:
        return _not_reached("MPI threads")
    if "error" in m:
        return Check("MPI threads", SKIP, "needs mpi4py")
    provided = m["thread_provided"]
    name = _THREAD_LEVELS.get(provided, str(provided))
    if provided >= m["thread_multiple"]:
        init = facts.get("horovod_init") or {}
        extra = "; horovod agrees" if init.get("mpi_threads_supported") else ""
        return Check("MPI threads", OK, name + " provided" + extra)
    if m.get("rc_thread_level") not in (None, "multiple"):
        return Check("MPI threads", FAIL,
                     "%s only: mpi4py asked for %r" % (name, m["rc_thread_level"]),
                     "unset MPI4PY_RC_THREAD_LEVEL (and do not set mpi4py.rc.thread_level): "
                     "horovod needs MPI_THREAD_MULTIPLE")
    return Check("MPI threads", FAIL, "this MPI provides only %s" % name,
                 "horovod's background thread needs MPI_THREAD_MULTIPLE: use an MPI built "
                 "with it (Open MPI >= 3.0 default; MPICH --enable-threads=multiple)")


def _check_same_mpi(facts) -> Check:
    ht, m = facts.get("horovod_torch"), facts.get("mpi4py")
    if ht is None or "error" in ht or m is None or "error" in m:
        return Check("one MPI library", SKIP, "needs horovod.torch and mpi4py")
    hv, added = ht.get("libmpi"), m.get("libmpi_added")
    if hv is None or added is None:
        return Check("one MPI library", WARN, "cannot tell: /proc/self/maps is not readable",
                     "check by hand: ldd on horovod/torch/mpi_lib_v2*.so and mpi4py/MPI*.so")
    if added:
        return Check("one MPI library", FAIL,
                     "two MPI libraries in one process: horovod loads %s, mpi4py adds %s"
                     % (", ".join(hv) or "none", ", ".join(added)),
                     "make mpi4py use horovod's MPI: with that MPI's mpicc on PATH, "
                     ".venv/bin/pip install --force-reinstall --no-binary mpi4py mpi4py; "
                     "or load the MPI you want and rebuild horovod (%s)" % SETUP)
    if not hv:
        return Check("one MPI library", WARN, "no libmpi found in the process",
                     "check by hand: ldd on horovod/torch/mpi_lib_v2*.so")
    return Check("one MPI library", OK, "horovod and mpi4py both use " + ", ".join(hv))


def _check_init(facts) -> Check:
    ht = facts.get("horovod_torch")
    if ht is None or "error" in ht or "error" in (facts.get("torch") or {"error": 1}):
        return Check("horovod init", SKIP, "needs torch and horovod.torch")
    init = facts.get("horovod_init")
    if init is None:
        return _not_reached("horovod init")
    if "error" in init:
        return Check("horovod init", FAIL, "hvd.init() in one process failed: " + init["error"],
                     "run `%s -c 'import horovod.torch as h; h.init()'` to see the whole "
                     "error; for MPI start-up errors try `mpirun -np 1 hostname`"
                     % sys.executable)
    if not init["allreduce_ok"]:
        return Check("horovod init", FAIL, "hvd.allreduce gave a wrong sum in one process",
                     "rebuild horovod: pip uninstall horovod, then %s" % SETUP)
    if not init["mpi_enabled"]:
        return Check("horovod init", WARN,
                     "hvd.init() did not enable MPI (size %d)" % init["size"],
                     "unset HOROVOD_GLOO* / HOROVOD_CONTROLLER if set; rebuild with MPI: %s"
                     % SETUP)
    return Check("horovod init", OK, "hvd.init() and allreduce work in one process (MPI)")


def _launcher_version(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             timeout=15).stdout.decode("utf-8", "replace")
    except (OSError, subprocess.SubprocessError) as e:
        return "version unknown (%s)" % type(e).__name__
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    # MPICH's Hydra prints "HYDRA build details:" first and "Version: x.y" later.
    for ln in lines:
        if re.search(r"\d+\.\d+", ln):
            return ln if mpi_family(ln) else "%s %s" % (_first_line(out), ln)
    return lines[0] if lines else "version unknown"


def _find_tool(name: str) -> Optional[str]:
    return (shutil.which(name) or
            shutil.which(name, path=os.path.dirname(sys.executable)))


def _check_launcher(facts) -> Check:
    mpirun, srun = shutil.which("mpirun"), shutil.which("srun")
    horovodrun = _find_tool("horovodrun")
    tail = "; horovodrun: %s" % (horovodrun or "not found")
    if srun:
        tail += "; srun: %s" % srun
    if not mpirun:
        if srun:
            return Check("launcher", WARN, "no mpirun" + tail,
                         "srun works only with an MPI built with Slurm/PMIx support; "
                         "otherwise module load your MPI so that mpirun is on PATH")
        return Check("launcher", FAIL, "no mpirun on PATH" + tail,
                     "install OpenMPI (apt-get install openmpi-bin libopenmpi-dev) or "
                     "module load openmpi, so that mpirun is on PATH")
    version = _launcher_version(mpirun)
    detail = "%s (%s)%s" % (mpirun, version, tail)
    m = facts.get("mpi4py") or {}
    lib = m.get("library_version")
    if lib:
        fam_run, fam_lib = mpi_family(version), mpi_family(lib)
        if fam_run and fam_lib and fam_run != fam_lib:
            return Check("launcher", FAIL,
                         "%s is %s but the processes load %s (%s): every rank would run "
                         "alone, as size 1" % (mpirun, fam_run, fam_lib, lib),
                         "put the mpirun of the MPI that horovod and mpi4py use first on "
                         "PATH (module load it), or rebuild both against this mpirun's MPI")
        v_run, v_lib = _version_tuple(version), _version_tuple(lib)
        if fam_run == fam_lib == "Open MPI" and v_run and v_lib and v_run[:2] != v_lib[:2]:
            return Check("launcher", WARN, "%s; library is %s" % (detail, lib),
                         "Open MPI needs mpirun and library of one release: put the "
                         "matching mpirun first on PATH")
    return Check("launcher", OK, detail)


def _check_data() -> Check:
    folder = os.environ.get("OMNIHVD_DATA") or DATA_DIR
    missing = [f + ".gz" for f in DATA_FILES
               if not any(os.path.isfile(os.path.join(folder, f + ext)) for ext in (".gz", ""))]
    if missing:
        return Check("Fashion-MNIST", WARN, "%s lacks %s (benchmarks and demo need it)"
                     % (folder, ", ".join(missing)),
                     "apt-get install dataset-fashion-mnist (%s does), or set OMNIHVD_DATA "
                     "to a folder with the four IDX files" % SETUP)
    return Check("Fashion-MNIST", OK, folder)


# A CFS period longer than this lets a rank that waits for its peers -- MPI polls
# while it waits, which counts as CPU time -- exhaust its quota and then stall for
# the rest of the period; measured in docs/cpu-quotas.rst.
QUOTA_PERIOD_LIMIT_US = 20000
QUOTA_FIX = ("give the container a 10 ms period: docker run --cpu-period=10000 "
             "--cpu-quota=<cores x 10000> instead of --cpus; Kubernetes: kubelet "
             "cpuCFSQuotaPeriod: 10ms (feature gate CustomCPUCFSQuotaPeriod); or exclusive "
             "cores instead of a quota (docker --cpuset-cpus; Kubernetes static CPU manager "
             "with integer CPU requests); and/or run the ranks with "
             "OMPI_MCA_mpi_yield_when_idle=1 (mpirun -x); do not raise HOROVOD_CYCLE_TIME; "
             "see docs/cpu-quotas.rst")


def _check_cpu_quota(root: str = "/", cpus: Optional[int] = None) -> Check:
    """WARN when this process runs under a CFS quota with a long period, or under a
    quota of fewer cores than the ``cpus`` it may run on (default: its affinity), or
    when its cpu cgroup cannot be found; see docs/cpu-quotas.rst. A quota of at least
    as many cores as its group's processes may use CPUs cannot throttle, whatever its
    period."""
    from ..cpuquota import SPREAD_FIX, cpu_groups, cpu_quotas, group_cpus, quota_spread, usable_cpus

    cpus = usable_cpus() if cpus is None else cpus
    unseen = "; if the job runs under a quota, pass cpu_quota=<cores> to the callback"
    quotas = cpu_quotas("self", root=root)
    if not quotas:
        groups = cpu_groups("self", root=root)
        lost = [controller.mount for controller, folder in groups if folder is None]
        if lost:
            return Check("CPU quota", WARN, "this process's cpu cgroup is not in %s (a cgroup "
                         "namespace or a container that shows another part of the tree), so "
                         "its quota cannot be read" % ", ".join(lost),
                         "mount the cgroup filesystem inside the container's namespace" + unseen)
        if not groups:
            return Check("CPU quota", OK, "no cgroup cpu controller is mounted here, so no "
                         "CFS quota can be seen" + unseen)
        return Check("CPU quota", OK, "no CFS quota on this process")
    detail = "; ".join("%.2f cores per %g ms (%s)" % (q.cores, q.period_us / 1000, q.path)
                       for q in quotas)
    problems, fixes = [], []
    # a quota throttles only where its group's processes can use more CPUs than it gives
    if any(q.period_us > QUOTA_PERIOD_LIMIT_US and q.cores < max(group_cpus(q.path), cpus)
           for q in quotas):
        problems.append("with a period this long, a rank that polls in MPI while waiting for "
                        "its peers uses up its quota and stalls for the rest of the period "
                        "(plain Horovod at 100/60/30% of a core took 155 ms per step with a "
                        "100 ms period, 87 ms with 10 ms: docs/cpu-quotas.rst)")
        fixes.append(QUOTA_FIX)
    spread = quota_spread(min(q.cores for q in quotas), cpus)
    if spread:
        problems.append(spread)
        fixes.append(SPREAD_FIX)
    if not problems:
        return Check("CPU quota", OK, detail)
    return Check("CPU quota", WARN, "CFS quota " + detail + ": " + "; and ".join(problems),
                 "; and ".join(fixes))


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "signal %d" % number


def _check_probe(facts) -> Optional[Check]:
    """A FAIL when the child stopped before the end; None when it finished."""
    if facts.get("done"):
        return None
    child = facts["child"]
    code = child["returncode"]
    if child["timed_out"]:
        why = "timed out"
    elif isinstance(code, int) and code < 0:
        why = "was killed by %s" % _signal_name(-code)
    else:
        why = "stopped (exit status %s)" % code
    step = facts.get("step", "start-up")
    return Check("check process", FAIL, "the child process %s during %s: %s"
                 % (why, step, child["output_tail"][-500:] or "no output"),
                 "run `%s -c 'import torch, horovod.torch; from mpi4py import MPI'` to see "
                 "it; a crash there usually means two MPI libraries or a horovod built for "
                 "another torch (rerun %s); a hang, an MPI that cannot start (try "
                 "`mpirun -np 1 hostname`)" % (sys.executable, SETUP))


_CHECKS = (_check_torch, _check_cuda, _check_horovod, _check_horovod_build, _check_mpi4py,
           _check_threads, _check_same_mpi, _check_init, _check_launcher)


def run_checks(timeout: float = 60.0):
    """Run every check.

    Args:
        timeout: seconds allowed to the child process that imports torch, horovod
            and mpi4py and starts MPI.

    Returns:
        ``(checks, facts)``: a list of :class:`Check` and the raw facts the child
        reported (see :func:`probe`).

    Example:
        >>> checks, _ = run_checks()
        >>> ok = not any(c.status == "FAIL" for c in checks)
    """
    try:
        facts = probe(timeout)
    except Exception as e:  # noqa: BLE001 - e.g. cannot start a process at all
        facts = {"child": {"returncode": None, "timed_out": False,
                           "output_tail": _short_error(e)}}
    checks = []
    for check in _CHECKS:
        try:
            checks.append(check(facts))
        except Exception as e:  # noqa: BLE001 - a bug here must not hide the others
            checks.append(Check(check.__name__[7:], FAIL, "the check itself failed: "
                                + _short_error(e), "report this as an omnihvd bug"))
    for name, check in (("Fashion-MNIST", _check_data), ("CPU quota", _check_cpu_quota)):
        try:
            checks.append(check())
        except Exception as e:  # noqa: BLE001
            checks.append(Check(name, WARN, _short_error(e), ""))
    stopped = _check_probe(facts)
    if stopped is not None:
        checks.append(stopped)
    return checks, facts


# --------------------------------------------------------------------------- command

def configure_parser(parser) -> None:
    """Add the ``omnihvd doctor`` options to an argparse parser."""
    parser.add_argument("--quiet", action="store_true",
                        help="print only problems (WARN and FAIL) and their fixes")
    parser.add_argument("--json", action="store_true",
                        help="print the checks and the raw facts as JSON")
    # here, not at the top: the check process runs this file alone (runpy), outside
    # the package
    from .cli import positive

    parser.add_argument("--timeout", type=positive(float, "number of seconds"), default=60.0,
                        metavar="SECONDS",
                        help="time allowed to import torch/horovod/mpi4py and start "
                             "MPI (default: %(default)s)")


def _format(checks, quiet: bool) -> str:
    lines = []
    if not quiet:
        from .. import __version__
        lines.append("omnihvd doctor: omnihvd %s, Python %s (%s)"
                     % (__version__, sys.version.split()[0], sys.executable))
    for c in checks:
        if quiet and c.status in (OK, SKIP):
            continue
        lines.append("  %-5s %-16s %s" % (c.status, c.name, c.detail))
        if c.fix:
            lines.append("  %-5s %-16s fix: %s" % ("", "", c.fix))
    fails = sum(c.status == FAIL for c in checks)
    warns = sum(c.status == WARN for c in checks)
    if fails:
        lines.append("%d problem(s) need fixing (FAIL above)%s"
                     % (fails, ", %d warning(s)" % warns if warns else ""))
    elif not quiet:
        lines.append("everything needed works%s" % (" (%d warning(s))" % warns if warns else ""))
    return "\n".join(lines)


def run(args) -> int:
    """Run ``omnihvd doctor``; return 1 when a check FAILs, else 0."""
    checks, facts = run_checks(timeout=args.timeout)
    failed = any(c.status == FAIL for c in checks)
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [c._asdict() for c in checks],
                          "facts": facts}, indent=2))
    else:
        text = _format(checks, args.quiet)
        if text:
            print(text)
    return 1 if failed else 0
