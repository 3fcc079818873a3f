"""The GPU checks (benchmarks/gpu_timing_check.py, gpu_ddp_balance.py, gpu_ddp_check.py,
gpu_horovod_balance.py, gpu_horovod.sh): their verdict logic and their behaviour without
a GPU; gpu_horovod.sh's build preparation (dry run) on a stand-in sdist."""
import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_ddp_balance as balance  # noqa: E402
import gpu_horovod_balance as hvd_balance  # noqa: E402
import gpu_timing_check as check  # noqa: E402

pytestmark = pytest.mark.single


def medians(omni_large, host_large=0.1):
    return {"n=1": {"cuda_events": 1.0, "omnihvd": 1.0, "host_only": 0.1},
            "n=2": {"cuda_events": 8.0, "omnihvd": omni_large, "host_only": host_large}}


def test_passes_when_omnihvd_follows_the_events_and_host_time_does_not():
    passed, rows, lines = check.verdict(medians(8.5))
    assert passed and lines[-1].startswith("PASS")
    assert [r[0] for r in rows] == ["cuda_events", "omnihvd", "host_only"]
    assert rows[1][3] == pytest.approx(8.5) and rows[1][4] == pytest.approx(8.5 / 8 - 1)


@pytest.mark.parametrize("omni", [7.1, 9.0])
def test_fails_outside_ten_percent(omni):
    passed, _, lines = check.verdict(medians(omni))
    assert not passed and lines[-1].startswith("FAIL: omnihvd ratio")


def test_fails_when_the_workloads_cannot_tell_the_timers_apart():
    passed, _, lines = check.verdict(medians(8.0, host_large=0.78))
    assert not passed and "cannot tell the timers apart" in lines[-1]


def with_peer_wait(omni_small, wide_small, wait=0.05):
    m = medians(8.4)
    for name, events in (("n=1", 1.0), ("n=2", 8.0)):
        m[name].update(cuda_events=events * 1e-3, omnihvd=m[name]["omnihvd"] * 1e-3,
                       host_only=m[name]["host_only"] * 1e-3, device_wide=events * 1e-3 + wait)
    m["n=1"].update(omnihvd=omni_small, device_wide=wide_small)
    return m


def test_passes_when_omnihvd_leaves_out_the_peer_wait_that_the_whole_device_sync_waits_for():
    passed, rows, lines = check.verdict(with_peer_wait(0.0011, 0.051), peer_wait=0.05)
    assert passed and lines[-2].startswith("PASS") and lines[-1].startswith("PASS: omnihvd left")
    assert [r[0] for r in rows] == ["cuda_events", "omnihvd", "host_only", "device_wide"]


def test_fails_when_omnihvd_waits_for_the_peers_stream():
    # torch.cuda.synchronize() as the sync (what the docs forbid): the ratio may even hold
    passed, _, lines = check.verdict(with_peer_wait(0.0505, 0.051), peer_wait=0.05)
    assert not passed and "includes the peer wait" in lines[-1]


def test_fails_when_the_peer_wait_never_held_the_device():
    passed, _, lines = check.verdict(with_peer_wait(0.0011, 0.0012), peer_wait=0.05)
    assert not passed and "cannot tell the syncs apart" in lines[-1]


def test_needs_exactly_two_workloads():
    with pytest.raises(ValueError, match="two workloads"):
        check.verdict({"a": medians(8.0)["n=1"]})


@pytest.mark.parametrize("command", [["gpu_timing_check.py"],
                                     ["gpu_timing_check.py", "--workload", "train"],
                                     ["gpu_ddp_balance.py"], ["gpu_ddp_check.py"],
                                     ["gpu_horovod_balance.py"]])
def test_without_cuda_it_says_so_and_exits_2(command):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the script would run the real check")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", command[0])]
                          + command[1:], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stdout and "nothing was checked" in proc.stdout


def test_both_workloads_have_two_sizes_the_smaller_first():
    for build, sizes in check.WORKLOADS.values():
        assert callable(build) and len(sizes) == 2 and sizes[0] < sizes[1]


@pytest.mark.parametrize("auto, host, auto_ms, passed", [
    (400, 1024, 20.0, True),     # 19.5% of the batch against 50%
    (921, 1024, 20.0, True),     # 44.97%, 5.03% below
    (922, 1024, 20.0, False),    # 45.02%: more than 45%
    (900, 950, 20.0, False),     # 43.9%, but only 2.4% below host time only
    (400, 1024, 30.0, False),    # the split moved, but the step got no shorter
])
def test_balance_verdict_needs_a_clear_shift_away_from_the_slow_device(auto, host, auto_ms,
                                                                       passed):
    B = 2048
    results = {"auto": {"sizes": [B - auto, auto], "median_step_ms": auto_ms},
               "host": {"sizes": [B - host, host], "median_step_ms": 30.0}}
    ok, line = balance.verdict(results, B)
    assert ok is passed and line.startswith("PASS" if passed else "FAIL")


@pytest.mark.parametrize("module", [check, balance, hvd_balance])
def test_docstring_examples(module):
    import doctest
    failed, attempted = doctest.testmod(module, verbose=False)
    assert attempted >= 2 and failed == 0


@pytest.mark.parametrize("omni, omni_ms, passed", [
    (264, 20.0, True),      # 25.8% against plain's 50%, half the step
    (460, 20.0, True),      # 44.9%
    (462, 20.0, False),     # 45.1%: more than 45%
    (264, 36.0, True),      # 0.90 of plain's step
    (264, 36.5, False),     # the split moved, but the step is not 10% shorter
])
def test_horovod_balance_verdict_needs_fewer_samples_and_a_shorter_step(omni, omni_ms, passed):
    B = 1024
    results = {"omnihvd": {"sizes": [B - omni, omni], "median_step_ms": omni_ms},
               "plain": {"sizes": [B // 2, B // 2], "median_step_ms": 40.0}}
    ok, line = hvd_balance.verdict(results, B)
    assert ok is passed and line.startswith("PASS" if passed else "FAIL")
    results["host"] = {"sizes": [100, 924], "median_step_ms": 70.0}   # reported, not judged
    ok, line = hvd_balance.verdict(results, B)
    assert ok is passed and line.endswith("by the host alone it gets 90.2%, 70.0 ms per step")


SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_horovod.sh")


def fake_sdist(folder, cuda_standard="11"):
    """A stand-in for horovod-0.28.1.tar.gz: the files gpu_horovod.sh checks and patches."""
    top = os.path.join(str(folder), "horovod-0.28.1")
    files = {
        "setup.py": "",
        "CMakeLists.txt": "cmake_minimum_required(VERSION 3.13 FATAL_ERROR)\n",
        "horovod/torch/mpi_ops_v2.cc": "",
        "horovod/common/ops/cuda/CMakeLists.txt":
            "set(CMAKE_CUDA_STANDARD %s)\nset(CMAKE_CUDA_STANDARD_REQUIRED ON)\n" % cuda_standard,
        "horovod/torch/CMakeLists.txt":
            'execute_process(COMMAND ${PY_EXE} -c "from distutils.sysconfig import '
            'get_python_inc; print(get_python_inc())"\n',
    }
    for name, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(top, name)), exist_ok=True)
        with open(os.path.join(top, name), "w") as f:
            f.write(text)
    path = os.path.join(str(folder), "horovod-0.28.1.tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        tar.add(top, arcname="horovod-0.28.1")
    return path


def run_script(tmp_path, **env):
    env = dict(os.environ, GPU_HOROVOD_PREFIX=str(tmp_path / "prefix"), **env)
    env.pop("OUT", None)
    return subprocess.run(["bash", SCRIPT, str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=120, env=env)


def test_horovod_dry_run_says_how_to_get_the_sdist_when_it_is_missing(tmp_path):
    proc = run_script(tmp_path, GPU_HOROVOD_DRY_RUN="1",
                      HOROVOD_SDIST=str(tmp_path / "absent.tar.gz"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no Horovod source at" in proc.stdout
    assert "tools/fetch_horovod_sdist.sh" in proc.stdout and "carry .cache" in proc.stdout


def test_horovod_dry_run_unpacks_patches_and_prints_the_build_command(tmp_path):
    proc = run_script(tmp_path, GPU_HOROVOD_DRY_RUN="1", HOROVOD_SDIST=fake_sdist(tmp_path),
                      HOROVOD_GPU_OPERATIONS="NCCL")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    src = tmp_path / "prefix" / "src" / "horovod-0.28.1"
    cuda = (src / "horovod/common/ops/cuda/CMakeLists.txt").read_text()
    assert "set(CMAKE_CUDA_STANDARD 17)" in cuda and "STANDARD 11" not in cuda
    torch_cmake = (src / "horovod/torch/CMakeLists.txt").read_text()
    assert "sysconfig.get_paths()['include']" in torch_cmake and "distutils" not in torch_cmake
    wrapper = (tmp_path / "prefix" / "bin" / "g++-c++17").read_text()
    assert wrapper.rstrip().endswith('-std=c++17')
    command = [l for l in proc.stdout.splitlines() if "build command" in l]
    assert command, proc.stdout
    for flag in ("HOROVOD_WITH_PYTORCH=1", "HOROVOD_WITHOUT_TENSORFLOW=1",
                 "HOROVOD_WITHOUT_MXNET=1", "--no-build-isolation", "--no-deps", "--no-index",
                 "--target " + str(tmp_path / "prefix" / "site"), "MAKEFLAGS=-j"):
        assert flag in command[0], (flag, command[0])
    assert "MAKEFLAGS=-j1 " not in command[0] or os.cpu_count() == 1   # not OMP_NUM_THREADS
    assert "HOROVOD_GPU" not in command[0]   # no GPU operations: no NCCL, unset if set
    assert "nothing built" in proc.stdout
    assert not (tmp_path / "prefix" / "site").exists()


def test_horovod_dry_run_fails_when_a_patch_does_not_apply(tmp_path):
    proc = run_script(tmp_path, GPU_HOROVOD_DRY_RUN="1",
                      HOROVOD_SDIST=fake_sdist(tmp_path, cuda_standard="14"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "patch failed: CMAKE_CUDA_STANDARD" in proc.stdout


def test_horovod_script_without_cuda_says_so_and_exits_2(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the script would run the real check")
    proc = run_script(tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stdout and "nothing was checked" in proc.stdout
