"""A complete torchrun + DistributedDataParallel training script with omnihvd (no Horovod).

The DDP twin of examples/train_fashion_mnist.py: Fashion-MNIST, a small CNN, the
same options and the same per-epoch line. The omnihvd lines are marked "# omnihvd".
Run it like any torchrun job (gloo on CPUs; NCCL with one GPU per rank)::

    torchrun --standalone --nproc-per-node 3 examples/train_fashion_mnist_ddp.py --epochs 1
    torchrun --standalone --nproc-per-node 3 examples/train_fashion_mnist_ddp.py --slowdown 1,1,3

--mode chooses how the global batch is split over the ranks:

  omnihvd  (default) omnihvd.Balancer and its loader, default options
  tuned    the same with tune_split=True (the split also tuned by the step period)
  plain    plain DDP: equal batches from a DistributedSampler, no omnihvd at all
  fixed    omnihvd's sampler and gradient weighting with the sizes of --split
           (e.g. --split 128,64,64) and balancing off: a hand-picked static split

--start-split 128,64,64 starts omnihvd (or tuned) from these sizes instead of the
equal split (initial_batch_sizes).

--slowdown makes rank i's model slower: each forward pass sleeps, inside the pass,
``(factor - 1) * 3 *`` its own duration. That is ``factor`` times the work where
backward costs twice the forward; on this model on a CPU backward costs less.
--checkpoint PATH saves the model, optimizer and omnihvd's state after every
epoch and resumes from it when it exists.

Rank 0 prints one line per epoch: ``epoch E: T s, test accuracy A, batch sizes
[b_0, ...], overhead O ms/step``, where T is the training time of the epoch
(evaluation excluded) and the sizes are those in force at its end.
"""
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import omnihvd
from omnihvd.tools.data import fashion_mnist
from omnihvd.tools.models import SmallCNN

from example_args import balancer_options, end_epoch, parse_args, plain_loader, resume, slow_down

def main():
    args = parse_args(__doc__.splitlines()[0])
    gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if gpu else "gloo")   # torchrun set RANK, WORLD_SIZE, ...
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if gpu else None
    if gpu:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(message)s")
    torch.manual_seed(args.seed)
    train = fashion_mnist("train", limit=args.limit)
    test = fashion_mnist("test", limit=2000)
    net = SmallCNN().to(device)
    # DDP broadcasts rank 0's parameters when it wraps the model.
    model = torch.nn.parallel.DistributedDataParallel(net, device_ids=[device] if gpu else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    bal = None
    if args.mode == "plain":
        sampler, loader = plain_loader(train, args.global_batch_size, rank, size,
                                       seed=args.seed)
    else:
        bal = omnihvd.Balancer(model, opt, global_batch_size=args.global_batch_size,   # omnihvd
                               **balancer_options(args))
        loader = bal.loader(train, seed=args.seed, drop_last=True)                      # omnihvd
        sampler = loader.sampler

    start_epoch = resume(args.checkpoint, model.module, opt, bal, loader, map_location=device)
    slow_down(model, args, rank)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        # Start the epoch's clock together: the time is then training alone, not also
        # rank 0 waiting in the first allreduce for a slower rank's evaluation.
        dist.barrier()
        t0 = time.perf_counter()
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        seconds = time.perf_counter() - t0
        end_epoch(args, epoch, seconds, evaluate(model.module, test, device), bal, loader,
                  model.module, opt, rank, size)
    if bal is not None:
        bal.close()
    dist.destroy_process_group()


def evaluate(net, dataset, device):
    # The wrapped module, not the DDP model: evaluation needs no collectives.
    net.eval()
    with torch.no_grad():
        x, y = dataset.tensors
        return float((net(x.to(device)).argmax(1) == y.to(device)).float().mean())


if __name__ == "__main__":
    main()
