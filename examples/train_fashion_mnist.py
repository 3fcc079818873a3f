"""A complete Horovod training script with omnihvd: Fashion-MNIST, a small CNN.

Shaped like Horovod's examples/pytorch/pytorch_mnist.py; the omnihvd lines are
marked "# omnihvd". Run it like any Horovod job:

    .venv/bin/horovodrun -np 4 .venv/bin/python examples/train_fashion_mnist.py --epochs 1
    mpirun -np 4 .venv/bin/python examples/train_fashion_mnist.py --slowdown 1,1,2,4

--mode chooses how the global batch is split over the ranks:

  omnihvd  (default) OmniLearnCallback + HeterogeneousBatchSampler, default options
  tuned    the same with tune_split=True (the split also tuned by the step period)
  plain    plain Horovod: equal batches from a DistributedSampler, no omnihvd at all
  fixed    omnihvd's sampler and gradient weighting with the sizes of --split
           (e.g. --split 128,64,64) and balancing off: a hand-picked static split

--start-split 128,64,64 starts omnihvd (or tuned) from these sizes instead of the
equal split (the callback's initial_batch_sizes).

--slowdown makes rank i's local work per step that many times slower (it sleeps
after backward, before opt.step()), to watch omnihvd rebalance on one machine.
OMNIHVD_EXAMPLE_ANATOMY=FOLDER in the environment records where each step's time
goes on each rank (benchmarks/step_anatomy.py summarises it).
--checkpoint PATH saves the model, optimizer, callback and sampler state after
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

from example_args import (StepAnatomy, callback_options, end_epoch, parse_args, plain_loader,
                          resume, slowdown)

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

    cb = None
    if args.mode == "plain":
        sampler, loader = plain_loader(train, args.global_batch_size, hvd.rank(), hvd.size(),
                                       seed=args.seed)
    else:
        options = callback_options(args)
        cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=args.global_batch_size,  # omnihvd
                                       **options)
        sampler = omnihvd.HeterogeneousBatchSampler(len(train), cb, seed=args.seed)           # omnihvd
        loader = torch.utils.data.DataLoader(train, batch_sampler=sampler)

    # Horovod's optimizer holds the state; omnihvd's callback and sampler hold theirs.
    start_epoch = resume(args.checkpoint, model, opt, cb, sampler)
    factor = slowdown(args, hvd.rank())
    anatomy = StepAnatomy(args, hvd.rank())  # off unless OMNIHVD_EXAMPLE_ANATOMY is set

    if hvd.rank() == 0:   # every rank is here (the broadcast): benchmarks/realhet.py reads it
        print("training starts", flush=True)
    if cb is not None:
        cb.on_train_begin()                                                              # omnihvd
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        if cb is not None:
            cb.on_epoch_begin(epoch)                                                     # omnihvd
        model.train()
        # Start the epoch's clock together: the time is then training alone, not also
        # rank 0 waiting in the first allreduce for a slower rank's evaluation.
        hvd.barrier()
        t0 = time.perf_counter()
        for x, y in loader:
            anatomy.begin()
            if cb is not None:
                cb.on_batch_begin()                                                      # omnihvd
            begin = time.perf_counter()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if factor > 1:
                time.sleep((factor - 1) * (time.perf_counter() - begin))
            anatomy.before_step()
            opt.step()
            anatomy.after_step(len(y), cb)
            if cb is not None:
                cb.on_batch_end()                                                        # omnihvd
        if cb is not None:
            cb.on_epoch_end(epoch)                                                       # omnihvd
        seconds = time.perf_counter() - t0
        anatomy.end_epoch(epoch)
        end_epoch(args, epoch, seconds, evaluate(model, test), cb, loader, model, opt, sampler,
                  hvd.rank(), hvd.size())
    if cb is not None:
        cb.on_train_end()


def evaluate(model, dataset):
    model.eval()
    device = next(model.parameters()).device
    with torch.no_grad():
        x, y = (t.to(device) for t in dataset.tensors)
        return float((model(x).argmax(1) == y).float().mean())


if __name__ == "__main__":
    main()
