"""The DDP backend (omnihvd.ddp) under ``torchrun --nproc-per-node 3`` (gloo, CPU).

Exactness against a one-process replay with sizes changing mid-run, sampler coverage,
errors on every rank, loops that end with a gather due, and a failing rank ending
the job. None of it needs Horovod: every script run here hides it first.
"""
import json
import os
import re

import pytest

from torchrun import torchrun

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_scripts")
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("workers,drop_last,tune", [(0, 1, ""), (2, 0, ""), (0, 1, "tune")])
def test_weighted_gradient_equals_single_process_global_batch(workers, drop_last, tune):
    # Sizes switch at steps 1 and 2 (a loaded schedule) and then by the controller
    # (rank 0 is slowed; with "tune" also by tune_split's probes); rank 0 replays
    # every step in one process (float64).
    out = torchrun(3, os.path.join(HERE, "ddp_train.py"), workers, drop_last,
                   *([tune] if tune else [])).stdout
    line = [l for l in out.splitlines() if l.startswith("DDP-RESULT ")]
    assert line and "DDP-OK" in out, out[-4000:]
    r = json.loads(line[0][len("DDP-RESULT "):])
    assert r["max_grad_diff"] <= 1e-12 and r["max_param_diff"] <= 1e-12, r
    assert len(r["distinct_sizes"]) >= 3 and r["adjustments"] >= 1, r
    assert not r["horovod_imported"]


def test_bad_or_inconsistent_configuration_raises_on_every_rank():
    out = torchrun(3, os.path.join(HERE, "ddp_config.py"), timeout=180).stdout
    found = re.findall(r"RANK (\d) SCENARIO (\S+) ERROR (\w+): (.*?)(?=RANK \d|\n|$)", out)
    needles = {"bad-option-one-rank": ("rank 1", "deadband"),
               "initial-sizes-one-rank": ("rank 2", "initial_batch_sizes"),
               "not-ddp": ("DistributedDataParallel",),
               "own-hook-one-rank": ("rank 0", "communication hook"),
               "builtin-hook": ("communication hook", "BuiltinCommHookType.ALLREDUCE"),
               "hook-after-construction-one-rank": ("comm_hook", "rank 0 has 'allreduce_hook'"),
               "two-callbacks-one-model": ("hook of an earlier DDPOmniLearnCallback",),
               "batch-mismatch": ("global_batch_size",),
               "sampler-seed-mismatch": ("samplers",)}
    for name, words in needles.items():
        errors = [(r, kind, msg) for r, s, kind, msg in found if s == name]
        assert sorted(r for r, _, _ in errors) == ["0", "1", "2"], (name, out[-4000:])
        for _, kind, msg in errors:
            assert kind in ("ConfigError", "RankMismatchError"), (name, kind, msg)
            assert all(w in msg for w in words), (name, msg)
    assert out.count("horovod-imported=False") == 3, out[-3000:]


@pytest.mark.parametrize("shape", ["no_train_end", "slow_end", "blocking"])
def test_loop_ends_cleanly_on_every_rank(shape):
    # 30 steps, a decision every 10: a gather is due in the very last step, when the
    # fastest rank leaves; nothing may be left in flight for the slower ones.
    proc = torchrun(3, os.path.join(HERE, "ddp_loop_end.py"), shape, 30, 10, timeout=120,
                    check=False)
    assert proc.returncode == 0, "exit %d:\n%s" % (proc.returncode, proc.stdout[-4000:])
    done = [l for l in proc.stdout.splitlines() if "LOOP-END-OK" in l]
    assert len(done) == 3 and all(" steps 30 " in l for l in done), proc.stdout[-4000:]
    assert len({l.split(" sizes ")[1] for l in done}) == 1, done  # the same decisions


def test_a_failing_rank_ends_the_job():
    # Rank 1 raises while the others wait for it in DDP's allreduce, and a non-daemon
    # thread would keep its interpreter alive: the job must still end, non-zero,
    # with the rank named (run_bounded fails the test if it hangs).
    proc = torchrun(3, os.path.join(HERE, "ddp_fail.py"), timeout=120, check=False)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "omnihvd: rank 1 raised RuntimeError: injected failure at step 4" in proc.stdout
    assert "should not happen" not in proc.stdout


def test_gpu_balance_check_runs_its_plumbing_on_the_cpu():
    # benchmarks/gpu_ddp_balance.py as a GPU lease would run it, on the CPU: both runs
    # (device_sync "auto" and None) train, decide and end; their splits keep the batch.
    script = os.path.join(os.path.dirname(HERE), "..", "benchmarks", "gpu_ddp_balance.py")
    out = torchrun(2, script, "--device", "cpu", "--global-batch", 64, "--steps", 30).stdout
    line = [l for l in out.splitlines() if l.startswith("RESULT ")]
    assert line, out[-4000:]
    runs = json.loads(line[0][len("RESULT "):])
    assert sorted(runs) == ["auto", "host"], runs
    for run in runs.values():
        assert sum(run["sizes"]) == 64 and len(run["last_local_times_ms"]) == 2, run
        assert run["median_step_ms"] > 0, run
