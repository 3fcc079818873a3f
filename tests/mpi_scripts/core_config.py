"""Bad or inconsistent configuration under mpirun: every rank raises, nobody hangs.

Usage: core_config.py SCENARIO
  (bad-option-one-rank | batch-mismatch | model-mismatch | sampler-seed-mismatch |
   comm-one-rank | bad-comm-one-rank)
Each rank prints "RANK r ERROR <type>: <message>" or "RANK r NO ERROR".
"""
import sys

import torch
import horovod.torch as hvd

import omnihvd

scenario = sys.argv[1]
hvd.init()
rank = hvd.rank()
width = 5 if scenario == "model-mismatch" and rank == 1 else 4
model = torch.nn.Linear(width, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
kwargs = dict(global_batch_size=48)
if scenario == "bad-option-one-rank" and rank == 1:
    kwargs["adjust_every"] = 0
if scenario == "batch-mismatch" and rank == 2:
    kwargs["global_batch_size"] = 64
if scenario == "comm-one-rank" and rank == 1:   # an mpi4py Dup() on one rank alone
    from mpi4py import MPI
    kwargs["comm"] = MPI.COMM_WORLD
if scenario == "bad-comm-one-rank" and rank == 2:
    kwargs["comm"] = "world"
try:
    cb = omnihvd.OmniLearnCallback(model, opt, **kwargs)
    seed = 1 if scenario == "sampler-seed-mismatch" and rank == 1 else 0
    sampler = omnihvd.HeterogeneousBatchSampler(480, cb, seed=seed)
    cb.on_train_begin()
    print("RANK %d NO ERROR" % rank, flush=True)
except ValueError as exc:
    print("RANK %d ERROR %s: %s" % (rank, type(exc).__name__, exc), flush=True)
