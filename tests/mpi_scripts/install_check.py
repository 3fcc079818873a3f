"""Run on every rank by tests/test_install.py: horovod and mpi4py in one process.

Usage: mpirun -np N python install_check.py ORDER, with ORDER one of

- ``mpi4py-first``: mpi4py initialises MPI, then ``hvd.init(comm=MPI.COMM_WORLD)``
  (how omnihvd's comm module starts Horovod on the same communicator);
- ``horovod-first``: ``hvd.init()`` initialises MPI, then mpi4py is imported.

Checks, on each rank: hvd.allreduce (Sum and Average), a DistributedOptimizer step
equal to one process's SGD step on the union of all ranks' data, and
MPI.COMM_WORLD.allgather interleaved with Horovod's collectives (so Horovod's
background thread and mpi4py use MPI at the same time). Prints
``INSTALL-CHECK OK rank=R size=N order=ORDER`` on success; on failure prints the
traceback and aborts the whole job, so no rank waits forever.
"""
import sys
import traceback

import torch

ORDERS = ("mpi4py-first", "horovod-first")
PER_RANK = 8


def start(order):
    """Initialise MPI and Horovod in the given order; return (hvd, MPI)."""
    if order == "mpi4py-first":
        from mpi4py import MPI
        assert MPI.Is_initialized()
        import horovod.torch as hvd
        hvd.init(comm=MPI.COMM_WORLD)
    else:
        import horovod.torch as hvd
        hvd.init()
        from mpi4py import MPI
    return hvd, MPI


def check_allreduce(hvd):
    r, n = hvd.rank(), hvd.size()
    x = torch.tensor([r + 1.0, 2.0 * r])
    summed = hvd.allreduce(x, op=hvd.Sum, name="sum")
    want = torch.tensor([n * (n + 1) / 2.0, float(n * (n - 1))])
    assert torch.allclose(summed, want), (summed, want)
    averaged = hvd.allreduce(x, op=hvd.Average, name="avg")
    assert torch.allclose(averaged, want / n), (averaged, want / n)


def check_optimizer(hvd, world):
    """Two DistributedOptimizer steps equal two SGD steps on all ranks' data at once."""
    r, n = hvd.rank(), hvd.size()
    g = torch.Generator().manual_seed(1)
    x_all = torch.randn(n * PER_RANK, 3, generator=g)
    y_all = torch.randn(n * PER_RANK, 1, generator=g)
    torch.manual_seed(100 + r)  # different start on each rank: broadcast must fix it
    model = torch.nn.Linear(3, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    reference = torch.nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())

    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    mine = slice(r * PER_RANK, (r + 1) * PER_RANK)
    for step in range(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x_all[mine]), y_all[mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x_all), y_all).backward()
        ref_opt.step()
        # mpi4py between Horovod steps, while Horovod's background thread runs.
        assert world.allgather((r, step)) == [(i, step) for i in range(n)]
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-6), (name, p, q)
    # Every rank holds the same parameters.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0), name="params")
    assert torch.allclose(gathered, flat.expand_as(gathered)), gathered


def main(order):
    if order not in ORDERS:
        raise SystemExit("install_check.py: ORDER must be one of %s, got %r" % (ORDERS, order))
    hvd, MPI = start(order)
    world = MPI.COMM_WORLD
    assert (hvd.size(), hvd.rank()) == (world.Get_size(), world.Get_rank()), \
        "horovod sees rank %d of %d, mpi4py rank %d of %d" % (
            hvd.rank(), hvd.size(), world.Get_rank(), world.Get_size())
    assert hvd.mpi_enabled() and hvd.mpi_threads_supported()
    assert world.allgather(hvd.rank()) == list(range(hvd.size()))
    check_allreduce(hvd)
    check_optimizer(hvd, world)
    assert world.allreduce(1) == hvd.size()
    print("INSTALL-CHECK OK rank=%d size=%d order=%s" % (hvd.rank(), hvd.size(), order),
          flush=True)


if __name__ == "__main__":
    try:
        main(sys.argv[1] if len(sys.argv) > 1 else "")
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        if "mpi4py.MPI" in sys.modules:
            sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(1)
        raise
