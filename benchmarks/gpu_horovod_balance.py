"""GPU check of the Horovod path end to end: omnihvd.Balancer under Horovod moves
samples away from a rank whose device work the host cannot see, and the step gets
shorter than plain Horovod's equal split.

Two ranks under ``mpirun`` (Horovod built for the GPU's torch without GPU operations:
a CUDA tensor's allreduce goes through host memory, so a CPU rank and a GPU rank can
share one allreduce; see benchmarks/gpu_horovod.sh) train the same MLP on synthetic
28x28 images with ``hvd.DistributedOptimizer``, global batch ``--global-batch``.
Rank 0 trains on the CPU (one thread). Rank 1 trains on the GPU and stands for a
slow device: its forward also queues a spin kernel (``torch.cuda._sleep``) of
``--slow-factor`` times rank 0's measured time per sample for each of its samples --
device work in proportion to its batch that returns to the host at once. With equal
local times it would get ``1 / (1 + slow_factor)`` of the batch (25% at 3).

Runs, one after the other in one launch, each from the even split:

* ``omnihvd``: the drop-in (:class:`omnihvd.Balancer` and its loader; the loop is a
  plain Horovod loop), ``device_sync="auto"`` (the default);
* ``host``: the same with ``device_sync=None``, host time only (information: what
  the device sync is for; GPU only);
* ``plain``: plain Horovod, every rank ``global_batch / 2`` samples.

Rank 0 prints each run's final split, the last decision's local times and the
median wall time per step over the run's second half. PASS when ``omnihvd`` gives
rank 1 (the slow device) at most 45% of the global batch, at least 5 points less
than ``plain`` does, and ``omnihvd``'s step is at least 10% shorter than ``plain``'s.

``--device cpu`` runs the same on the CPU, for a machine without a GPU (the test
suite does): both ranks on the CPU, rank 1 slowed by a host sleep of the same size
inside its forward (so its slowness is visible to the host, and the ``host`` run is
left out), by default with a smaller batch, fewer steps and a fixed sleep of 1 ms
per sample (on a shared CPU the fixed cost of a step would hide a small slowness);
the verdict applies as well.

Usage::

    mpirun -np 2 python benchmarks/gpu_horovod_balance.py              # one GPU
    mpirun -np 2 python benchmarks/gpu_horovod_balance.py --device cpu   # no GPU, ~20 s

Exit status: 0 PASS, 1 FAIL, 2 no CUDA device (nothing was checked).
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

SLOW_RANK = 1
MAX_SHARE = 0.45    # omnihvd: the slow rank's share of the global batch at most
MIN_GAP = 0.05      # omnihvd below plain by at least this share
MAX_STEP = 0.90     # omnihvd's step at most this fraction of plain's
FEATURES = 28 * 28
POOL = 4096         # distinct synthetic samples; the epoch cycles through them
DEFAULTS = {"cuda": {"global_batch": 1024, "steps": 300, "adjust_every": 10, "slow_factor": 3.0},
            "cpu": {"global_batch": 256, "steps": 40, "adjust_every": 4, "slow_us": 1000.0}}


def verdict(results, global_batch):
    """PASS/FAIL from the runs' final splits and step times.

    Args:
        results: ``{"omnihvd": {"sizes": [b0, b1], "median_step_ms": t},
            "plain": {...}}``, optionally ``"host"`` (reported, not judged).
        global_batch: B.

    Returns:
        ``(passed, line)``.

    >>> verdict({"omnihvd": {"sizes": [760, 264], "median_step_ms": 20.0},
    ...          "plain": {"sizes": [512, 512], "median_step_ms": 40.0}}, 1024)
    (True, 'PASS: the slow rank gets 25.8% of the batch with omnihvd, 50.0% with plain Horovod; 20.0 against 40.0 ms per step (0.50)')
    >>> verdict({"omnihvd": {"sizes": [760, 264], "median_step_ms": 37.0},
    ...          "plain": {"sizes": [512, 512], "median_step_ms": 40.0}}, 1024)[0]
    False
    >>> verdict({"omnihvd": {"sizes": [520, 504], "median_step_ms": 20.0},
    ...          "plain": {"sizes": [512, 512], "median_step_ms": 40.0}}, 1024)[0]
    False
    """
    omni, plain = results["omnihvd"], results["plain"]
    omni_share = omni["sizes"][SLOW_RANK] / global_batch
    plain_share = plain["sizes"][SLOW_RANK] / global_batch
    ratio = omni["median_step_ms"] / plain["median_step_ms"]
    passed = (omni_share <= MAX_SHARE and plain_share - omni_share >= MIN_GAP
              and ratio <= MAX_STEP)
    line = ("%s: the slow rank gets %.1f%% of the batch with omnihvd, %.1f%% with plain "
            "Horovod; %.1f against %.1f ms per step (%.2f)"
            % ("PASS" if passed else "FAIL", 100 * omni_share, 100 * plain_share,
               omni["median_step_ms"], plain["median_step_ms"], ratio))
    if "host" in results:
        host = results["host"]
        line += ("; timed by the host alone it gets %.1f%%, %.1f ms per step"
                 % (100 * host["sizes"][SLOW_RANK] / global_batch, host["median_step_ms"]))
    return passed, line


class Synthetic:
    """Images and labels, indexed a batch at a time (``__getitems__``: the
    DataLoader's fetcher takes a batch in one call, no per-sample collate)."""

    def __init__(self, length, seed=0):
        import torch

        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(POOL, FEATURES, generator=gen)
        self.y = torch.randint(0, 10, (POOL,), generator=gen)
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return self.x[i % POOL], self.y[i % POOL]

    def __getitems__(self, indices):
        import torch

        idx = torch.as_tensor(indices) % POOL
        return self.x[idx], self.y[idx]


def as_batch(batch):
    """The loader's collate_fn: ``__getitems__`` already made the batch."""
    return batch


def build_net(spin_cycles_per_sample=0.0, sleep_per_sample=0.0):
    """The MLP. ``spin_cycles_per_sample`` (CUDA): its forward also queues a spin
    kernel of that many cycles per sample; ``sleep_per_sample`` (CPU): it sleeps that
    many seconds per sample. Either is this rank's slowness, inside its model."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(),
                                            torch.nn.Linear(256, 10))

        def forward(self, x):
            if spin_cycles_per_sample:   # device work the host does not wait for
                torch.cuda._sleep(int(spin_cycles_per_sample * len(x)))
            if sleep_per_sample:         # host-visible slowness (--device cpu)
                time.sleep(sleep_per_sample * len(x))
            return self.body(x)

    torch.manual_seed(0)
    return Net()


def train(mode, args, hvd, rank, device, slowness):
    """One run from the even split: the final sizes, the last decision's local times
    and the median wall time per step over the second half."""
    import torch

    import omnihvd

    size = hvd.size()
    net = build_net(**slowness).to(device)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01),
                                   named_parameters=net.named_parameters())
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    data = Synthetic(args.global_batch * args.steps)
    walls, last = [], [None]

    def tick():
        now = time.perf_counter()
        if last[0] is not None:
            walls.append(now - last[0])
        last[0] = now

    def step(x, y):
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    if mode == "plain":   # Horovod's own loop: an equal share of each global batch
        share = args.global_batch // size
        for s in range(args.steps):
            tick()
            start = s * args.global_batch + rank * share
            step(*data.__getitems__(list(range(start, start + share))))
        sizes, times, adjustments = [share] * size, None, 0
    else:
        advanced = {"device_sync": None} if mode == "host" else {}
        bal = omnihvd.Balancer(net, opt, global_batch_size=args.global_batch,
                               min_batch_size=8, adjust_every=args.adjust_every,
                               advanced=advanced)
        for x, y in bal.loader(data, collate_fn=as_batch):   # the loop calls no omnihvd
            tick()
            step(x, y)
        bal.close()
        sizes = list(bal.batch_sizes)
        times = next((h["times"] for h in reversed(bal.history) if h.get("times")), None)
        adjustments = bal.callback.adjustments
    if device.type == "cuda":
        torch.cuda.synchronize()
    hvd.allreduce(torch.zeros(1), name="run_end.%s" % mode)   # the runs stay apart
    late = walls[len(walls) // 2:]
    return {"sizes": sizes, "adjustments": adjustments,
            "last_local_times_ms": [round(1e3 * t, 3) for t in times] if times else None,
            "median_step_ms": round(1e3 * statistics.median(late), 3),
            "step_ms_quartiles": [round(1e3 * q, 3) for q in statistics.quantiles(late, n=4)]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: both ranks on the CPU, rank 1 slowed by a host sleep "
                             "(and the defaults below in brackets)")
    parser.add_argument("--global-batch", type=int, help="default 1024 [256]")
    parser.add_argument("--steps", type=int, help="steps per run (default 300 [40])")
    parser.add_argument("--adjust-every", type=int, help="default 10 [4]")
    parser.add_argument("--slow-factor", type=float,
                        help="rank 1's extra time per sample, in multiples of rank 0's "
                             "measured time per sample on the CPU (default 3)")
    parser.add_argument("--slow-us", type=float,
                        help="rank 1's extra time per sample in microseconds, instead of "
                             "--slow-factor ([1000]: on a shared CPU rank 0's measured cost "
                             "varies severalfold, and the fixed cost of a step would hide a "
                             "small slowness)")
    args = parser.parse_args(argv)
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_horovod_balance: no CUDA device is available here; this check needs one "
              "GPU (nothing was checked)", flush=True)
        return 2
    import horovod.torch as hvd

    import gpu_ddp_balance as ddp_check   # rank 0's cost and the spin rate, shared

    torch.set_num_threads(1)   # the CPU rank at one steady speed
    hvd.init()
    rank = hvd.rank()
    if hvd.size() != 2:
        raise SystemExit("gpu_horovod_balance needs exactly 2 ranks (mpirun -np 2)")
    cpu_cost = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        cpu_cost[0] = ddp_check.seconds_per_sample_on_cpu(args.global_batch // 2)
    cpu_cost = hvd.broadcast(cpu_cost, 0, name="cpu_cost")
    if args.slow_us is not None:                      # rank 1's extra seconds per sample
        extra = 1e-6 * args.slow_us
    else:
        extra = args.slow_factor * float(cpu_cost[0])
    device, slowness = torch.device("cpu"), {}
    if rank == SLOW_RANK and args.device == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        rate = ddp_check.spin_cycles_per_second()
        slowness = {"spin_cycles_per_sample": extra * rate}
        print("gpu_horovod_balance: rank %d on %s, torch %s; spin %.0f cycles (%.1f us) per "
              "sample, %.2f GHz" % (rank, torch.cuda.get_device_name(0), torch.__version__,
                                    extra * rate, 1e6 * extra, rate / 1e9), flush=True)
    elif rank == SLOW_RANK:
        slowness = {"sleep_per_sample": extra}
    placed = hvd.allgather_object(str(device))
    modes = ("omnihvd", "host", "plain") if args.device == "cuda" else ("omnihvd", "plain")
    results = {mode: train(mode, args, hvd, rank, device, slowness) for mode in modes}
    code = 0
    if rank == 0:
        print("gpu_horovod_balance: horovod %s (mpi %s, gloo %s, nccl %s, cuda %s), ranks on %s; "
              "global batch %d; rank 0 %.1f us per sample on the CPU; rank %d %.1f us per "
              "sample more (%s); with equal local times rank %d would get about %.0f%%"
              % (_horovod_version(), hvd.mpi_built(), hvd.gloo_built(), hvd.nccl_built(),
                 hvd.cuda_built(), placed, args.global_batch, 1e6 * float(cpu_cost[0]), SLOW_RANK, 1e6 * extra,
                 "a spin kernel on the GPU" if args.device == "cuda" else "a host sleep",
                 SLOW_RANK, 100 * float(cpu_cost[0]) / (
                     (2 if args.device == "cpu" else 1) * float(cpu_cost[0]) + extra)),
              flush=True)
        print("RESULT " + json.dumps(results), flush=True)
        passed, line = verdict(results, args.global_batch)
        print(line, flush=True)
        code = 0 if passed else 1
    code = int(hvd.broadcast(torch.tensor([code]), 0, name="verdict")[0])
    hvd.shutdown()
    return code


def _horovod_version():
    import horovod

    return horovod.__version__


if __name__ == "__main__":
    sys.exit(main())
