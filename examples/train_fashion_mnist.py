"""A complete Horovod training script with omnihvd: Fashion-MNIST, a small CNN.

Shaped like Horovod's examples/pytorch/pytorch_mnist.py; the omnihvd lines are
marked "# omnihvd". Run it like any Horovod job:

    .venv/bin/horovodrun -np 4 .venv/bin/python examples/train_fashion_mnist.py --epochs 1
    mpirun -np 4 .venv/bin/python examples/train_fashion_mnist.py --slowdown 1,1,2,4

--mode chooses how the global batch is split over the ranks:

  omnihvd  (default) omnihvd.Balancer and its loader, default options
  tuned    the same with tune_split=True (the split also tuned by the step period)
  plain    plain Horovod: equal batches from a DistributedSampler, no omnihvd at all
  fixed    omnihvd's sampler and gradient weighting with the sizes of --split
           (e.g. --split 128,64,64) and balancing off: a hand-picked static split

--start-split 128,64,64 starts omnihvd (or tuned) from these sizes instead of the
equal split (initial_batch_sizes).

--slowdown makes rank i's model that many times slower (it sleeps inside each
forward pass, as a slower device would take longer), to watch omnihvd rebalance on
one machine.
OMNIHVD_EXAMPLE_ANATOMY=FOLDER in the environment records where each step's time
goes on each rank (benchmarks/step_anatomy.py summarises it).
--checkpoint PATH saves the model, optimizer and omnihvd's state after
every epoch and resumes from it when it exists.

Rank 0 prints ``training starts`` once every rank has loaded the data and built the
model, then one line per epoch (benchmarks/realhet.py reads both):
``epoch E: T s, test accuracy A, batch sizes [b_0, ...], ...`` where T is the
training time of the epoch (evaluation excluded) and the sizes are those in force
at its end.
"""
import logging
import time

import torch
import torch.nn.functional as F
import horovod.torch as hvd

import omnihvd
from omnihvd.tools.data import fashion_mnist
from omnihvd.tools.models import SmallCNN

from example_args import (StepAnatomy, balancer_options, end_epoch, parse_args, plain_loader,
                          resume, slow_down)

def main():
    args = parse_args(__doc__.splitlines()[0])
    hvd.init()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO if hvd.rank() == 0 else logging.WARNING,
                        format="%(message)s")
    torch.manual_seed(args.seed)
    # one GPU per rank where there are GPUs, as in Horovod's examples
    device = torch.device("cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda", hvd.local_rank())
    train = fashion_mnist("train", limit=args.limit)
    test = fashion_mnist("test", limit=2000)
    model = SmallCNN().to(device)
    base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    bal = None
    if args.mode == "plain":
        sampler, loader = plain_loader(train, args.global_batch_size, hvd.rank(), hvd.size(),
                                       seed=args.seed)
    else:
        bal = omnihvd.Balancer(model, opt, global_batch_size=args.global_batch_size,   # omnihvd
                               **balancer_options(args))
        loader = bal.loader(train, seed=args.seed, drop_last=True)                      # omnihvd
        sampler = loader.sampler

    # Horovod's optimizer holds the state; omnihvd's balancer holds its own.
    start_epoch = resume(args.checkpoint, model, opt, bal, loader)
    slow_down(model, args, hvd.rank())
    anatomy = StepAnatomy(args, hvd.rank())  # off unless OMNIHVD_EXAMPLE_ANATOMY is set
    cb = None if bal is None else bal.callback   # its step times, for the anatomy

    if hvd.rank() == 0:   # every rank is here (the broadcast): benchmarks/realhet.py reads it
        print("training starts", flush=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        # Start the epoch's clock together: the time is then training alone, not also
        # rank 0 waiting in the first allreduce for a slower rank's evaluation.
        hvd.barrier()
        t0 = time.perf_counter()
        for x, y in loader:
            anatomy.begin()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            anatomy.before_step()
            opt.step()
            anatomy.after_step(len(y), cb)
        seconds = time.perf_counter() - t0
        anatomy.end_epoch(epoch)
        end_epoch(args, epoch, seconds, evaluate(model, test), bal, loader, model, opt,
                  hvd.rank(), hvd.size())


def evaluate(model, dataset):
    model.eval()
    device = next(model.parameters()).device
    with torch.no_grad():
        x, y = (t.to(device) for t in dataset.tensors)
        return float((model(x).argmax(1) == y).float().mean())


if __name__ == "__main__":
    main()
