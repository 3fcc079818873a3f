"""The DDP backend (omnihvd.ddp): one process here, three ranks under a real torchrun.

Single process (a gloo world of one, made here): the comm hook's factor, the timing
boundary at the last bucket, errors, and that the module runs with Horovod hidden.
Under ``torchrun --nproc-per-node 3`` (gloo, CPU): exactness against a one-process
replay with sizes changing mid-run, sampler coverage, errors on every rank, and a
failing rank ending the job. None of it needs Horovod: every script run here hides it.
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from mpirun import ROOT
from torchrun import torchrun

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_scripts")


@pytest.fixture()
def world_of_one(tmp_path):
    """A one-rank gloo process group for the duration of a test."""
    dist.init_process_group("gloo", init_method="file://%s" % (tmp_path / "store"), rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def test_hook_scales_each_bucket_and_marks_only_the_last_one(world_of_one):
    from omnihvd.ddp import WeightedAllreduceState, weighted_allreduce_hook
    from omnihvd.weighting import GradientWeight

    x = torch.randn(10, 6, dtype=torch.float64)
    plain = _net()
    plain(x).pow(2).mean().backward()
    marks = []
    model = torch.nn.parallel.DistributedDataParallel(_net(), bucket_cap_mb=0.0005)
    state = WeightedAllreduceState(None, GradientWeight(0.25), marks.append)
    model.register_comm_hook(state, weighted_allreduce_hook)
    for _ in range(2):  # DDP rebuilds its buckets after the first pass
        model.zero_grad()
        model(x).pow(2).mean().backward()
        # one rank: the factor weight / n is the whole scaling (DDP adds no division)
        for p, q in zip(model.parameters(), plain.parameters()):
            assert torch.equal(p.grad, 0.25 * q.grad)
    assert marks == [torch.device("cpu")] * 2  # once per backward, at the last bucket


def test_callback_in_a_world_of_one_times_up_to_the_last_bucket(world_of_one):
    import omnihvd

    model = torch.nn.parallel.DistributedDataParallel(_net(), bucket_cap_mb=0.0005)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cb = omnihvd.DDPOmniLearnCallback(model, global_batch_size=8, adjust_every=2)
    assert (cb.rank, cb.num_ranks, cb.batch_sizes, cb.batch_size) == (0, 1, [8], 8)
    cb.on_train_begin()
    for _ in range(5):
        cb.on_batch_begin()
        opt.zero_grad()
        loss = model(torch.randn(8, 6, dtype=torch.float64)).pow(2).mean()
        assert cb._timer.running
        loss.backward()
        assert not cb._timer.running  # the step's time ended inside backward (last bucket)
        opt.step()
        cb.on_batch_end()
    cb.on_train_end()
    assert len(cb.history) == 2 and cb._pending is None  # no gather left after the run
    state = cb.state_dict()
    assert state["step"] == 5 and state["batch_sizes"] == [8]


def test_a_step_without_allreduce_is_not_timed(world_of_one):
    import omnihvd

    model = torch.nn.parallel.DistributedDataParallel(_net())
    cb = omnihvd.DDPOmniLearnCallback(model, global_batch_size=4, settle_steps=0)
    cb.on_train_begin()
    cb.on_batch_begin()
    with model.no_sync():
        model(torch.randn(4, 6, dtype=torch.float64)).sum().backward()
    cb.on_batch_end()
    assert len(cb._window) == 0  # dropped: no boundary was seen
    cb.on_train_end()


def test_errors_without_a_process_group_or_ddp_model(world_of_one):
    import omnihvd
    from omnihvd.errors import ConfigError

    with pytest.raises(ConfigError, match="DistributedDataParallel"):
        omnihvd.DDPOmniLearnCallback(_net(), global_batch_size=4)
    with pytest.raises(ConfigError, match="adjust_every"):
        omnihvd.DDPOmniLearnCallback(torch.nn.parallel.DistributedDataParallel(_net()), 4,
                                     adjust_every=0)


def test_error_before_init_process_group():
    import omnihvd
    from omnihvd.errors import ConfigError

    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="init_process_group"):
        omnihvd.DDPOmniLearnCallback(_net(), global_batch_size=4)


def test_ddp_backend_needs_no_horovod(tmp_path):
    # A fresh interpreter in which `import horovod` fails: the DDP path imports and
    # trains a step in a world of one without it.
    code = """
import sys
sys.modules["horovod"] = None
import torch, torch.distributed as dist, omnihvd
dist.init_process_group("gloo", init_method="file://%s", rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
cb = omnihvd.DDPOmniLearnCallback(model, global_batch_size=4)
sampler = omnihvd.HeterogeneousBatchSampler(8, cb, seed=0)
cb.on_train_begin()
for idx in sampler:
    cb.on_batch_begin()
    model(torch.randn(len(idx), 3)).sum().backward()
    cb.on_batch_end()
cb.on_train_end()
dist.destroy_process_group()
print("steps", cb.step, "horovod", [m for m in sys.modules if m.startswith("horovod")
                                    and sys.modules[m] is not None])
""" % (tmp_path / "store")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "steps 2 horovod []" in out.stdout, out.stdout[-3000:]


# ------------------------------------------------------------ torchrun, 3 ranks
@pytest.mark.mpi
@pytest.mark.parametrize("workers,drop_last", [(0, 1), (2, 0)])
def test_weighted_gradient_equals_single_process_global_batch(workers, drop_last):
    # Sizes switch at steps 1 and 2 (a loaded schedule) and then by the controller
    # (rank 0 is slowed); rank 0 replays every step in one process (float64).
    out = torchrun(3, os.path.join(HERE, "ddp_train.py"), workers, drop_last).stdout
    line = [l for l in out.splitlines() if l.startswith("DDP-RESULT ")]
    assert line and "DDP-OK" in out, out[-4000:]
    r = json.loads(line[0][len("DDP-RESULT "):])
    assert r["max_grad_diff"] <= 1e-12 and r["max_param_diff"] <= 1e-12, r
    assert len(r["distinct_sizes"]) >= 3 and r["adjustments"] >= 1, r
    assert not r["horovod_imported"]


@pytest.mark.mpi
def test_bad_or_inconsistent_configuration_raises_on_every_rank():
    out = torchrun(3, os.path.join(HERE, "ddp_config.py"), timeout=180).stdout
    found = re.findall(r"RANK (\d) SCENARIO (\S+) ERROR (\w+): (.*?)(?=RANK \d|\n|$)", out)
    needles = {"bad-option-one-rank": ("rank 1", "deadband"),
               "initial-sizes-one-rank": ("rank 2", "initial_batch_sizes"),
               "not-ddp": ("DistributedDataParallel",),
               "own-hook-one-rank": ("rank 0", "communication hook"),
               "batch-mismatch": ("global_batch_size",),
               "sampler-seed-mismatch": ("samplers",)}
    for name, words in needles.items():
        errors = [(r, kind, msg) for r, s, kind, msg in found if s == name]
        assert sorted(r for r, _, _ in errors) == ["0", "1", "2"], (name, out[-4000:])
        for _, kind, msg in errors:
            assert kind in ("ConfigError", "RankMismatchError"), (name, kind, msg)
            assert all(w in msg for w in words), (name, msg)
    assert out.count("horovod-imported=False") == 3, out[-3000:]


@pytest.mark.mpi
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


@pytest.mark.mpi
def test_a_failing_rank_ends_the_job():
    # Rank 1 raises while the others wait for it in DDP's allreduce, and a non-daemon
    # thread would keep its interpreter alive: the job must still end, non-zero,
    # with the rank named (run_bounded fails the test if it hangs).
    proc = torchrun(3, os.path.join(HERE, "ddp_fail.py"), timeout=120, check=False)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "omnihvd: rank 1 raised RuntimeError: injected failure at step 4" in proc.stdout
    assert "should not happen" not in proc.stdout
