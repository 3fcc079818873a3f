"""The loop-end scripts' shared parts (tests/mpi_scripts/loop_end.py under mpirun and
tests/ddp_scripts/ddp_loop_end.py under torchrun): the data, the ranks' unequal speed
and the README-shaped loop with its ending shapes. Imports torch only.

Shapes the loop knows (each script documents the ones it runs):
  break      every rank breaks out of the epoch at the same step
  slow_end   rank 0 spends 0.2 s between opt.step() and cb.on_batch_end() in the
             last step (logging, metrics, a checkpoint)
  break_mid  every rank breaks out of the first epoch between opt.step() and
             cb.on_batch_end() of its 10th step (a max-steps check placed after the
             step; a gather is in flight there when adjust_every is 10), then runs
             a second epoch
  any other  the plain loop
"""
import time

import torch


def per_sample_seconds(rank):
    """Rank r is (r + 1) times slower per sample."""
    return 0.0002 * (1 + rank)


def dataset(global_batch_size, steps):
    """``steps`` global batches of a small regression problem, the same on every rank."""
    n = global_batch_size * steps
    gen = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 4, generator=gen),
                                          torch.randn(n, generator=gen))


def train(cb, sampler, loader, model, opt, *, shape, steps, rank, before_step=None):
    """One epoch of the drop-in loop; ``before_step(samples)`` runs before opt.step()."""
    cb.on_train_begin()
    for epoch in range(2 if shape == "break_mid" else 1):
        sampler.set_epoch(epoch)
        cb.on_epoch_begin(epoch)
        for i, (x, y) in enumerate(loader):
            if shape == "break" and i == steps // 2 + 1:
                break
            cb.on_batch_begin()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x).squeeze(1), y).backward()
            if before_step is not None:
                before_step(len(x))
            opt.step()
            if shape == "break_mid" and epoch == 0 and i == 9:
                break
            if shape == "slow_end" and rank == 0 and i == steps - 1:
                time.sleep(0.2)
            cb.on_batch_end()
        cb.on_epoch_end(epoch)
