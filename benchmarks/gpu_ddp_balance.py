"""GPU check, end to end: omnihvd moves samples away from a rank whose device work
the host cannot see.

Two ranks share one CUDA GPU (``torchrun --nproc_per_node 2``, gloo carrying CUDA
tensors; no Horovod, no NCCL, which refuses two ranks on one device). Each trains a
small convolutional net on synthetic 28x28 images, wrapped in DistributedDataParallel
with :class:`omnihvd.DDPOmniLearnCallback`, global batch ``--global-batch``, from
the even split. Rank 1 stands for a slower GPU: its forward also queues ``--extra``
more convolutions per sample (results unused), device work in proportion to its batch
that returns to the host at once. Two runs in one launch:

* ``auto``: ``device_sync="auto"`` (the default): the local time waits for the
  model's compute stream at the wait boundary;
* ``host``: ``device_sync=None``: host time only, what omnihvd timed before.

For each run rank 0 prints the final split, the last decision's local times and the
median wall time per step over the second half. PASS when ``auto`` gives rank 1
(the slow device) at most 45% of the global batch and at least 5% of it less than
``host`` does.

Usage::

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        benchmarks/gpu_ddp_balance.py              # about 30 s on one GPU

Exit status: 0 PASS, 1 FAIL, 2 no CUDA device (nothing was checked).
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SLOW_RANK = 1
MAX_SHARE = 0.45   # auto: the slow device's share of the global batch at most
MIN_GAP = 0.05     # auto below host by at least this share


def verdict(results, global_batch):
    """PASS/FAIL from the two runs' final splits.

    Args:
        results: ``{"auto": {"sizes": [b0, b1], ...}, "host": {...}}``.
        global_batch: B.

    Returns:
        ``(passed, line)``.

    >>> verdict({"auto": {"sizes": [700, 324]}, "host": {"sizes": [512, 512]}}, 1024)
    (True, 'PASS: the slow device gets 31.6% of the batch timed with device sync, 50.0% with host time only')
    >>> verdict({"auto": {"sizes": [520, 504]}, "host": {"sizes": [512, 512]}}, 1024)[0]
    False
    """
    auto = results["auto"]["sizes"][SLOW_RANK] / global_batch
    host = results["host"]["sizes"][SLOW_RANK] / global_batch
    passed = auto <= MAX_SHARE and host - auto >= MIN_GAP
    return passed, ("%s: the slow device gets %.1f%% of the batch timed with device sync, "
                    "%.1f%% with host time only"
                    % ("PASS" if passed else "FAIL", 100 * auto, 100 * host))


def build_net(extra):
    """The net; with ``extra`` > 0 its forward queues that many unused convolutions."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(1, 32, 3)
            self.conv2 = torch.nn.Conv2d(32, 64, 3)
            self.head = torch.nn.Sequential(torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                                            torch.nn.Linear(64 * 12 * 12, 10))

        def forward(self, x):
            h = torch.relu(self.conv1(x))
            with torch.no_grad():
                for _ in range(extra):  # the slower device: work the host does not wait for
                    self.conv2(h)
            return self.head(torch.relu(self.conv2(h)))

    torch.manual_seed(0)
    return Net()


def train(option, args, rank):
    """One run from the even split; the final sizes, local times and step wall time."""
    import torch

    import omnihvd

    net = build_net(args.extra if rank == SLOW_RANK else 0).to(args.device)
    model = torch.nn.parallel.DistributedDataParallel(
        net, device_ids=[0] if args.device == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cb = omnihvd.DDPOmniLearnCallback(model, global_batch_size=args.global_batch,
                                      adjust_every=args.adjust_every, min_batch_size=8,
                                      device_sync=option)
    x = torch.randn(args.global_batch, 1, 28, 28, device=args.device)
    y = torch.randint(0, 10, (args.global_batch,), device=args.device)
    walls, last = [], None
    cb.on_train_begin()
    for _ in range(args.steps):
        now = time.perf_counter()
        if last is not None:
            walls.append(now - last)
        last = now
        cb.on_batch_begin()
        b = cb.batch_sizes_at(cb.step)[rank]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[:b]), y[:b]).backward()
        opt.step()
        cb.on_batch_end()
    cb.on_train_end()
    times = next((h["times"] for h in reversed(cb.history) if h.get("times")), None)
    return {"sizes": list(cb.batch_sizes), "adjustments": cb.adjustments,
            "last_local_times_ms": [round(1e3 * t, 3) for t in times] if times else None,
            "median_step_ms": round(1e3 * statistics.median(walls[len(walls) // 2:]), 3)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--global-batch", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=300, help="steps per run")
    parser.add_argument("--adjust-every", type=int, default=10)
    parser.add_argument("--extra", type=int, default=8,
                        help="unused convolutions per forward on the slow rank")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu runs the same plumbing without a GPU (the extra work is "
                             "then on the host, so both runs see it: no verdict is drawn)")
    args = parser.parse_args(argv)
    import torch
    import torch.distributed as dist

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_ddp_balance: no CUDA device is available here; this check needs one GPU "
              "(nothing was checked)")
        return 2
    if args.device == "cuda":
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise SystemExit("gpu_ddp_balance needs exactly 2 ranks (torchrun --nproc_per_node 2)")
    results = {option or "host": train(option, args, rank) for option in ("auto", None)}
    code = 0
    if rank == 0:
        where = torch.cuda.get_device_name(0) if args.device == "cuda" else "the CPU"
        print("gpu_ddp_balance on %s, torch %s, global batch %d, slow rank %d (+%d convs)"
              % (where, torch.__version__, args.global_batch, SLOW_RANK, args.extra))
        print("RESULT " + json.dumps(results))
        if args.device == "cuda":
            passed, line = verdict(results, args.global_batch)
            print(line)
            code = 0 if passed else 1
    dist.barrier()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
