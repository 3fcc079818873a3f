"""Bad or inconsistent DDP configurations raise on every rank, run by tests/test_ddp.py.

Each scenario builds a DDP model on every rank, makes one rank (or all) get it
wrong, and prints ``RANK r SCENARIO s ERROR Type: message`` per rank; ranks then go
on to the next scenario in the same process group (an error that hung one rank
would stop the script, and the test's timeout would say so). Horovod is hidden.

Usage: ddp_config.py
"""
import sys

sys.modules["horovod"] = None  # the DDP path must not need Horovod

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import omnihvd  # noqa: E402

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()


def ddp(net=None):
    torch.manual_seed(0)
    return torch.nn.parallel.DistributedDataParallel(net or torch.nn.Linear(4, 2))


def scenario(name):
    """The callback construction (and train begin) each scenario gets wrong."""
    if name == "bad-option-one-rank":
        cb = omnihvd.DDPOmniLearnCallback(ddp(), 12, deadband=-1.0 if rank == 1 else 0.05)
    elif name == "initial-sizes-one-rank":
        cb = omnihvd.DDPOmniLearnCallback(ddp(), 12, initial_batch_sizes=[4, 4, 5]
                                          if rank == 2 else [4, 4, 4])
    elif name == "not-ddp":
        cb = omnihvd.DDPOmniLearnCallback(torch.nn.Linear(4, 2), 12)
    elif name == "own-hook-one-rank":
        model = ddp()
        if rank == 0:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.allreduce_hook)
        cb = omnihvd.DDPOmniLearnCallback(model, 12)
    elif name == "builtin-hook":   # DDP records built-in hooks outside _comm_hooks
        model = ddp()
        model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        cb = omnihvd.DDPOmniLearnCallback(model, 12)
    elif name == "hook-after-construction-one-rank":   # torch's raw error on one rank
        model = ddp()
        cb = omnihvd.DDPOmniLearnCallback(model, 12)
        if rank == 0:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.allreduce_hook)
        cb.on_train_begin()
    elif name == "two-callbacks-one-model":   # both built before either started
        model = ddp()
        first = omnihvd.DDPOmniLearnCallback(model, 12)
        second = omnihvd.DDPOmniLearnCallback(model, 12)
        first.on_train_begin()
        second.on_train_begin()
    elif name == "batch-mismatch":   # valid on each rank alone; ranks disagree
        cb = omnihvd.DDPOmniLearnCallback(ddp(), 13 if rank == 2 else 12)
        cb.on_train_begin()
    elif name == "sampler-seed-mismatch":
        cb = omnihvd.DDPOmniLearnCallback(ddp(), 12)
        omnihvd.HeterogeneousBatchSampler(48, cb, seed=rank)
        cb.on_train_begin()
    else:
        raise SystemExit("unknown scenario %r" % name)
    return cb


SCENARIOS = ["bad-option-one-rank", "initial-sizes-one-rank", "not-ddp", "own-hook-one-rank",
             "builtin-hook", "hook-after-construction-one-rank", "two-callbacks-one-model",
             "batch-mismatch", "sampler-seed-mismatch"]
for name in SCENARIOS:
    try:
        scenario(name)
        line = "RANK %d SCENARIO %s NO-ERROR" % (rank, name)
    except ValueError as exc:
        line = "RANK %d SCENARIO %s ERROR %s: %s" % (rank, name, type(exc).__name__,
                                                      str(exc).replace("\n", " "))
    sys.stdout.write(line + "\n")  # one write per line: ranks share torchrun's stdout
    sys.stdout.flush()
    dist.barrier()  # every rank is through this scenario: none hangs in it
print("RANK %d DONE horovod-imported=%s" % (rank, sys.modules.get("horovod") is not None),
      flush=True)
dist.destroy_process_group()
