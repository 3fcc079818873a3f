"""GPU check, end to end: omnihvd moves samples away from a rank whose device work
the host cannot see, and the step gets shorter for it.

Two ranks (``torchrun --nproc_per_node 2``, gloo; no Horovod) train the same MLP on
synthetic 28x28 images, wrapped in DistributedDataParallel with
:class:`omnihvd.DDPOmniLearnCallback`, global batch ``--global-batch``, from the even
split. Rank 0 trains on the CPU: work the host sees. Rank 1 trains alone on the GPU
and stands for a slow device: its forward also queues a spin kernel
(``torch.cuda._sleep``) of ``--slow-factor`` times rank 0's measured time per sample
for each of its samples -- device work in proportion to its batch that returns to the
host at once. Two runs in one launch:

* ``auto``: ``device_sync="auto"`` (the default): the local time waits for the
  model's compute stream at the wait boundary;
* ``host``: ``device_sync=None``: host time only, what omnihvd timed before.

For each run rank 0 prints the final split, the last decision's local times and the
median wall time per step over the second half. PASS when ``auto`` gives rank 1
(the slow device) at most 45% of the global batch, at least 5% of it less than
``host`` does, and ``auto``'s step is the shorter.

Why not two ranks on one GPU (this check's first version, run on an H200 on
2026-12-04): without MPS the GPU time-slices between the two processes, so each
rank's synchronised time also holds the other's kernels, and the split of least
total device work beats the split of equal local times (8.7 ms against 10.2 ms per
step there). That is no model of two GPUs; one rank per GPU is.

Usage::

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        benchmarks/gpu_ddp_balance.py              # about 40 s with one GPU

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
FEATURES = 28 * 28


def verdict(results, global_batch):
    """PASS/FAIL from the two runs' final splits and step times.

    Args:
        results: ``{"auto": {"sizes": [b0, b1], "median_step_ms": t}, "host": {...}}``.
        global_batch: B.

    Returns:
        ``(passed, line)``.

    >>> verdict({"auto": {"sizes": [700, 324], "median_step_ms": 20.0},
    ...          "host": {"sizes": [512, 512], "median_step_ms": 30.0}}, 1024)
    (True, 'PASS: the slow device gets 31.6% of the batch timed with device sync, 50.0% with host time only; 20.0 against 30.0 ms per step')
    >>> verdict({"auto": {"sizes": [520, 504], "median_step_ms": 20.0},
    ...          "host": {"sizes": [512, 512], "median_step_ms": 30.0}}, 1024)[0]
    False
    """
    auto, host = results["auto"], results["host"]
    auto_share = auto["sizes"][SLOW_RANK] / global_batch
    host_share = host["sizes"][SLOW_RANK] / global_batch
    passed = (auto_share <= MAX_SHARE and host_share - auto_share >= MIN_GAP
              and auto["median_step_ms"] < host["median_step_ms"])
    return passed, ("%s: the slow device gets %.1f%% of the batch timed with device sync, "
                    "%.1f%% with host time only; %.1f against %.1f ms per step"
                    % ("PASS" if passed else "FAIL", 100 * auto_share, 100 * host_share,
                       auto["median_step_ms"], host["median_step_ms"]))


def build_net(spin_cycles_per_sample=0):
    """The MLP; with ``spin_cycles_per_sample`` > 0 (CUDA only) its forward also queues a
    spin kernel of that many clock cycles per sample, whose result nothing uses."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(),
                                            torch.nn.Linear(256, 10))

        def forward(self, x):
            if spin_cycles_per_sample:  # the slower device: work the host does not wait for
                torch.cuda._sleep(int(spin_cycles_per_sample * len(x)))
            return self.body(x)

    torch.manual_seed(0)
    return Net()


def seconds_per_sample_on_cpu(batch, repeats=7):
    """Rank 0's cost: median seconds of one forward and backward per sample."""
    import torch

    net = build_net()
    x, y = torch.randn(batch, FEATURES), torch.randint(0, 10, (batch,))
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) / batch


def spin_cycles_per_second():
    """The GPU's rate for ``torch.cuda._sleep``, measured with CUDA events."""
    import torch

    cycles, rates = 1 << 22, []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(4):
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        rates.append(cycles / (start.elapsed_time(end) / 1000.0))
    return statistics.median(rates[1:])


def train(option, args, rank, device, spin_cycles_per_sample):
    """One run from the even split; the final sizes, local times and step wall time."""
    import torch

    import omnihvd

    net = build_net(spin_cycles_per_sample).to(device)
    model = torch.nn.parallel.DistributedDataParallel(
        net, device_ids=[0] if device == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cb = omnihvd.DDPOmniLearnCallback(model, global_batch_size=args.global_batch,
                                      adjust_every=args.adjust_every, min_batch_size=8,
                                      device_sync=option)
    x = torch.randn(args.global_batch, FEATURES, device=device)
    y = torch.randint(0, 10, (args.global_batch,), device=device)
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
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=300, help="steps per run")
    parser.add_argument("--adjust-every", type=int, default=10)
    parser.add_argument("--slow-factor", type=float, default=3.0,
                        help="the slow device's spin per sample, in multiples of rank 0's "
                             "measured time per sample on the CPU")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu runs the same plumbing without a GPU: both ranks on the "
                             "CPU, no spin, no verdict")
    args = parser.parse_args(argv)
    import torch
    import torch.distributed as dist

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_ddp_balance: no CUDA device is available here; this check needs one GPU "
              "(nothing was checked)")
        return 2
    torch.set_num_threads(1)  # rank 0's CPU work at one steady speed
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise SystemExit("gpu_ddp_balance needs exactly 2 ranks (torchrun --nproc_per_node 2)")
    on_gpu = args.device == "cuda" and rank == SLOW_RANK
    cpu_cost = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        cpu_cost[0] = seconds_per_sample_on_cpu(args.global_batch // 2)
    dist.broadcast(cpu_cost, 0)
    spin = 0
    if on_gpu:
        torch.cuda.set_device(0)
        rate = spin_cycles_per_second()
        spin = args.slow_factor * float(cpu_cost[0]) * rate
        print("gpu_ddp_balance: rank %d alone on %s, torch %s; spin %.0f cycles (%.1f us) per "
              "sample, %.2f GHz" % (rank, torch.cuda.get_device_name(0), torch.__version__,
                                    spin, 1e6 * spin / rate, rate / 1e9), flush=True)
    dist.barrier()
    results = {option or "host": train(option, args, rank, "cuda" if on_gpu else "cpu", spin)
               for option in ("auto", None)}
    code = 0
    if rank == 0:
        if args.device == "cuda":
            slower = args.slow_factor
            where = "on the GPU, %g times slower per sample" % slower
        else:
            where, slower = "on the CPU too (plumbing only)", 1.0
        print("gpu_ddp_balance: global batch %d; rank 0 on the CPU, %.1f us per sample; "
              "rank %d %s; with equal local times rank %d would get about %.0f%%"
              % (args.global_batch, 1e6 * float(cpu_cost[0]), SLOW_RANK, where, SLOW_RANK,
                 100 / (1 + slower)))
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
