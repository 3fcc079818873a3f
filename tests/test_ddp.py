"""The DDP backend (omnihvd.ddp) in one process (a gloo world of one, made here): the
comm hook's factor, the timing boundary at the last bucket, errors, the shared public
shape with OmniLearnCallback, and that the module runs with Horovod hidden. The
three-rank torchrun tests are in test_ddp_mpi.py.
"""
import inspect
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from mpirun import ROOT

pytestmark = pytest.mark.single


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


def test_cpu_buckets_are_fulfilled_on_this_thread_and_their_works_held(world_of_one):
    # gloo runs a chained then() callback on its worker thread and frees it there,
    # which aborts a process that is already exiting: on CPU the hook's futures carry
    # no callback, are fulfilled here when the last bucket arrives, and every work is
    # held past exit.
    from omnihvd import comm
    from omnihvd.ddp import WeightedAllreduceState, weighted_allreduce_hook

    futures = []

    def recording_hook(state, bucket):
        futures.append((bucket.is_last(), weighted_allreduce_hook(state, bucket)))
        assert all(f.done() for _, f in futures) == bucket.is_last()
        return futures[-1][1]

    model = torch.nn.parallel.DistributedDataParallel(_net(), bucket_cap_mb=0.0005)
    state = WeightedAllreduceState(None)
    model.register_comm_hook(state, recording_hook)
    for rebuilt in (False, True):  # DDP rebuilds its buckets after the first pass
        futures.clear()
        held_before = list(comm._held_works)
        model(torch.randn(4, 6, dtype=torch.float64)).sum().backward()
        assert futures[-1][0] and len(futures) >= (2 if rebuilt else 1)
        assert state._in_flight == []
        new = [w for w in comm._held_works if not any(w is h for h in held_before)]
        assert len(new) == len(futures)


EXIT_SCRIPT = r'''
import os, sys
sys.path.insert(0, %r)
from omnihvd.comm import hold_past_exit

# The class lives in a namespace of its own: the held instance keeps that alive, not
# __main__, whose variables finalisation clears.
namespace = {"write": os.write}
exec("""class Marker:
    def __init__(self, name):
        self.name = name

    def __del__(self):
        write(1, ("freed " + self.name + "\\n").encode())""", namespace)
loose = namespace["Marker"]("loose")
hold_past_exit(namespace["Marker"]("held"))
'''


def test_held_works_outlive_the_interpreter():
    # The object a gloo worker may release last must never be freed during
    # finalisation: a held one is not freed at all, a loose one (the control) is.
    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT % ROOT], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "freed loose" in out.stdout and "freed held" not in out.stdout, out.stdout


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


@pytest.mark.parametrize("option", ["callable", None])
def test_device_sync_runs_once_per_step_at_the_last_bucket(world_of_one, option):
    # The timer's device_sync is where the compute stream is waited for: the hooks
    # honour the option (None: host time only) and never sync outside the window.
    import omnihvd

    calls = []
    model = torch.nn.parallel.DistributedDataParallel(_net(), bucket_cap_mb=0.0005)
    sync = (lambda: calls.append(cb._timer.running)) if option else None
    cb = omnihvd.DDPOmniLearnCallback(model, global_batch_size=8, device_sync=sync)
    cb.on_train_begin()
    for _ in range(3):
        cb.on_batch_begin()
        model(torch.randn(8, 6, dtype=torch.float64)).pow(2).mean().backward()
        cb.on_batch_end()
    cb.on_batch_begin()  # a last bucket on a CUDA device: the hook itself waits for nothing
    cb._backend._on_last_bucket(torch.device("cuda", 0))
    cb.on_batch_end()
    cb.on_train_end()
    # inside the timed window only: where each of the model's passes ends (the forward
    # pass, then the last bucket; the backward pass ends after the wait began)
    assert calls == ([True] * (2 * 3 + 1) if option else [])


def test_a_step_without_allreduce_is_not_timed(world_of_one):
    import omnihvd

    model = torch.nn.parallel.DistributedDataParallel(_net())
    cb = omnihvd.DDPOmniLearnCallback(model, global_batch_size=4, settle_steps=0)
    cb.on_train_begin()
    cb.on_batch_begin()
    with model.no_sync():
        model(torch.randn(4, 6, dtype=torch.float64)).sum().backward()
    cb.on_batch_end()
    assert len(cb.cadence.window) == 0  # dropped: no boundary was seen
    cb.on_train_end()


def test_the_step_in_which_ddp_rebuilds_its_buckets_is_not_timed(world_of_one):
    # DDP's second forward rebuilds the buckets and broadcasts their layout over the
    # group: a wait for the peers inside the window (a fast rank read 23.3 ms there
    # against 1 ms at every other step, and the first decision moved the wrong way)
    import omnihvd

    model = torch.nn.parallel.DistributedDataParallel(_net(), bucket_cap_mb=0.0005)
    cb = omnihvd.DDPOmniLearnCallback(model, global_batch_size=8)
    cb.on_train_begin()
    timed = []
    for _ in range(4):
        cb.on_batch_begin()
        model(torch.randn(8, 6, dtype=torch.float64)).pow(2).mean().backward()
        cb.on_batch_end()
        timed.append(cb.last_step_time is not None)
    cb.on_train_end()
    assert model._has_rebuilt_buckets and timed == [True, False, True, True]


def test_state_dict_between_opt_step_and_on_batch_end_is_refused(world_of_one):
    # as for OmniLearnCallback: the model holds the step's update, the step is not
    # counted, so a resume would run it again (DDP's callback does not see the
    # optimizer; it returned the state)
    import omnihvd
    from omnihvd.errors import ConfigError

    model = torch.nn.parallel.DistributedDataParallel(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cb = omnihvd.DDPOmniLearnCallback(model, global_batch_size=8)
    cb.on_train_begin()
    for step in range(2):
        cb.on_batch_begin()
        opt.zero_grad()
        model(torch.randn(8, 6, dtype=torch.float64)).pow(2).mean().backward()
        assert cb.state_dict()["step"] == step   # before the update: a clean point
        opt.step()
        with pytest.raises(ConfigError, match="between opt.step"):
            cb.state_dict()
        cb.on_batch_end()
        assert cb.state_dict()["step"] == step + 1
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


def test_same_public_shape_as_the_horovod_callback():
    # The same hooks and signatures, and every option but comm= with the same default.
    from omnihvd.callback import OmniLearnCallback
    from omnihvd.ddp import DDPOmniLearnCallback

    for hook in ("on_train_begin", "on_epoch_begin", "on_batch_begin", "on_batch_end",
                 "on_epoch_end", "on_train_end", "state_dict", "load_state_dict"):
        assert (inspect.signature(getattr(DDPOmniLearnCallback, hook))
                == inspect.signature(getattr(OmniLearnCallback, hook))), hook
    hvd = inspect.signature(OmniLearnCallback.__init__).parameters
    ddp = inspect.signature(DDPOmniLearnCallback.__init__).parameters
    # the DDP model's optimizer comes last, optional (omnihvd.Balancer passes it)
    assert [n for n in hvd if n not in ("optimizer", "comm")] + ["optimizer"] == list(ddp)
    assert all(ddp[n].default == hvd[n].default for n in ddp if n != "optimizer"), ddp
