"""GPU check: omnihvd's local step time follows the device's work; host time does not.

On one CUDA GPU, without Horovod: two workloads run as "steps" -- ``--workload
matmul`` (default): square matmuls of two sizes on the weights of a model that lives
on the GPU; ``--workload train``: a training step (forward and backward of a small
convolutional net on 28x28 images) at two batch sizes, the quantity omnihvd's
controller divides between ranks. Each step is timed three ways from the same start:

* CUDA events around the step's kernels (the device's own account: the reference);
* omnihvd's StepTimer as the callback builds it: ``device_sync`` from
  :func:`omnihvd.device.device_synchronizer` (the model's compute stream), marked
  where ``opt.step()`` would be entered;
* a host-only StepTimer (what omnihvd measured before: launch time);
* a StepTimer whose sync is ``torch.cuda.synchronize()`` (the whole device).

After each step's kernels a kernel on a side stream spins ``--peer-wait-ms`` (default
50 ms): it stands for the wait for the other ranks, which Horovod's or NCCL's
allreduce spends on its own stream once the gradients are ready. The local time must
not include it.

The check passes when the ratio of the two workloads' median times measured by
omnihvd is within 10% of the ratio CUDA events measure, and the host-only ratio is
not (or the workloads would not tell the timers apart); and when omnihvd's times
stay clear of the peer wait (below the events' time plus half of it) while the
whole-device timer's do not (or the side stream never held the device, and nothing
would tell omnihvd's compute-stream sync from ``torch.cuda.synchronize()``). It also
prints the cost of the stream synchronisation itself on an idle stream, per call.

Usage::

    python benchmarks/gpu_timing_check.py              # about 30 s on one GPU
    python benchmarks/gpu_timing_check.py --sizes 1024 4096 --steps 40
    python benchmarks/gpu_timing_check.py --workload train   # batch sizes 256 and 2048
    python benchmarks/gpu_timing_check.py --peer-wait-ms 0   # no stand-in peer wait

Exit status: 0 PASS, 1 FAIL, 2 no CUDA device (nothing was checked).
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnihvd.timing import StepTimer  # noqa: E402

TOLERANCE = 0.10
TIMERS = ("cuda_events", "omnihvd", "host_only", "device_wide")
PEER_WAIT_MS = 50.0


def peer_wait_verdict(medians, peer_wait):
    """Whether omnihvd's times leave out a peer wait of ``peer_wait`` seconds that the
    whole-device timer's include, per workload: ``(passed, line)``.

    >>> peer_wait_verdict({"a": {"cuda_events": 0.001, "omnihvd": 0.0012, "device_wide": 0.051}},
    ...                   0.05)
    (True, 'PASS: omnihvd left out the 50.0 ms peer wait that torch.cuda.synchronize() waited for')
    """
    for name, m in medians.items():
        clear = m["cuda_events"] + peer_wait / 2
        if m["device_wide"] < clear:
            return False, ("FAIL: %s: the whole-device timer (%.1f ms) did not wait for the "
                           "%.1f ms peer wait: the check cannot tell the syncs apart"
                           % (name, 1e3 * m["device_wide"], 1e3 * peer_wait))
        if m["omnihvd"] >= clear:
            return False, ("FAIL: %s: omnihvd's time %.1f ms includes the peer wait (the "
                           "device's own work took %.1f ms)"
                           % (name, 1e3 * m["omnihvd"], 1e3 * m["cuda_events"]))
    return True, ("PASS: omnihvd left out the %.1f ms peer wait that torch.cuda.synchronize() "
                  "waited for" % (1e3 * peer_wait))


def verdict(medians, tolerance=TOLERANCE, peer_wait=None):
    """PASS/FAIL from per-workload median seconds.

    Args:
        medians: ``{workload: {"cuda_events": s, "omnihvd": s, "host_only": s}}``
            (and ``"device_wide": s`` with ``peer_wait``) with exactly two
            workloads, the smaller first.
        tolerance: allowed relative difference of the ratios.
        peer_wait: seconds of the stand-in peer wait on a side stream, or None
            (none ran): see :func:`peer_wait_verdict`.

    Returns:
        ``(passed, rows, lines)``: rows of (timer, small, large, ratio, ratio vs
        events) and the printable table with the verdict.

    >>> ok, _, lines = verdict({"a": {"cuda_events": 1.0, "omnihvd": 1.1, "host_only": 0.1},
    ...                        "b": {"cuda_events": 8.0, "omnihvd": 8.4, "host_only": 0.1}})
    >>> ok, lines[-1]
    (True, 'PASS: omnihvd ratio 7.64 is within 10% of the CUDA-event ratio 8.00; host-only 1.00 is not')
    """
    if len(medians) != 2:
        raise ValueError("verdict needs exactly two workloads, got %d" % len(medians))
    small, large = list(medians)
    timers = [t for t in TIMERS if t in medians[small]]
    ratios = {t: medians[large][t] / medians[small][t] for t in timers}
    ref = ratios["cuda_events"]
    rows = [(t, medians[small][t], medians[large][t], ratios[t], ratios[t] / ref - 1.0)
            for t in timers]
    lines = ["%-12s %14s %14s %8s %12s" % ("timer", "%s ms" % small, "%s ms" % large, "ratio",
                                            "vs events"),
             "-" * 64]
    lines += ["%-12s %14.3f %14.3f %8.2f %+11.1f%%" % (t, 1e3 * a, 1e3 * b, r, 100 * d)
              for t, a, b, r, d in rows]
    omni_ok = abs(ratios["omnihvd"] / ref - 1.0) <= tolerance
    host_apart = abs(ratios["host_only"] / ref - 1.0) > tolerance
    passed = omni_ok and host_apart
    if passed:
        lines.append("PASS: omnihvd ratio %.2f is within %d%% of the CUDA-event ratio %.2f; "
                     "host-only %.2f is not" % (ratios["omnihvd"], 100 * tolerance, ref,
                                                ratios["host_only"]))
    elif not omni_ok:
        lines.append("FAIL: omnihvd ratio %.2f is not within %d%% of the CUDA-event ratio %.2f"
                     % (ratios["omnihvd"], 100 * tolerance, ref))
    else:
        lines.append("FAIL: the host-only ratio %.2f is also within %d%% of the CUDA-event ratio "
                     "%.2f: these workloads cannot tell the timers apart (use larger --sizes)"
                     % (ratios["host_only"], 100 * tolerance, ref))
    if peer_wait:
        waited, line = peer_wait_verdict(medians, peer_wait)
        passed = passed and waited
        lines.append(line)
    return passed, rows, lines


def matmul_workload(size, repeats):
    """A model on the GPU and a step that queues ``repeats`` ``size``-square matmuls."""
    import torch

    model = torch.nn.Linear(size, size, bias=False).cuda()
    x = torch.randn(size, size, device="cuda")

    def step():
        with torch.no_grad():
            y = x
            for _ in range(repeats):
                y = model(y) * 1e-3  # forward "work"; keeps values finite
    return model, step


def train_workload(batch, repeats=None):
    """A small convolutional net on the GPU and a step that queues the forward and
    backward of one batch of ``batch`` 28x28 images (``repeats`` is not used)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(64 * 12 * 12, 128),
        torch.nn.ReLU(), torch.nn.Linear(128, 10)).cuda()
    x = torch.randn(batch, 1, 28, 28, device="cuda")
    y = torch.randint(0, 10, (batch,), device="cuda")

    def step():
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
    return model, step


WORKLOADS = {"matmul": (matmul_workload, (1024, 4096)), "train": (train_workload, (256, 2048))}


def sleep_cycles_per_second():
    """Clock cycles per second of ``torch.cuda._sleep`` on this GPU (measured)."""
    import torch

    torch.cuda._sleep(1000)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / (begin.elapsed_time(end) / 1e3)


def measure(size, steps, warmup, repeats, workload="matmul", peer_wait=0.0):
    """Median seconds per step of each timer for one workload."""
    import torch

    from omnihvd.device import device_synchronizer

    model, step = WORKLOADS[workload][0](size, repeats)
    # marked in this order: the host's time before any sync, the compute stream's
    # before the whole device's
    timers = {"host_only": StepTimer(), "omnihvd": StepTimer(device_sync=device_synchronizer(model)),
              "device_wide": StepTimer(device_sync=torch.cuda.synchronize)}
    side = torch.cuda.Stream()   # the allreduce's stream: where the wait for peers happens
    cycles = int(peer_wait * sleep_cycles_per_second()) if peer_wait else 0
    samples = {t: [] for t in TIMERS}
    for k in range(warmup + steps):
        torch.cuda.synchronize()  # stands for the end of the previous step's allreduce
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start = time.perf_counter()
        for timer in timers.values():
            timer.start(at=start)
        begin.record()
        step()
        end.record()
        if cycles:   # the gradients are ready: the allreduce waits for the others
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(cycles)
        for timer in timers.values():   # where opt.step() would be entered
            timer.mark_wait()
        end.synchronize()
        if k >= warmup:
            for name, timer in timers.items():
                samples[name].append(timer.stop())
            samples["cuda_events"].append(begin.elapsed_time(end) / 1e3)
        else:
            for timer in timers.values():
                timer.stop()
    return {t: statistics.median(v) for t, v in samples.items()}


def sync_cost(calls=2000):
    """Seconds per device_sync call on an idle stream (the floor of its cost)."""
    import torch

    from omnihvd.device import device_synchronizer

    sync = device_synchronizer(torch.nn.Linear(4, 4).cuda())
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        sync()
    return (time.perf_counter() - start) / calls


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="matmul",
                        help="matmul (default) or train (a conv net's forward and backward)")
    parser.add_argument("--sizes", type=int, nargs=2, default=None,
                        help="the two matrix sizes (matmul, default 1024 4096) or batch sizes "
                             "(train, default 256 2048)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per workload")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=8, help="matmuls per step (matmul)")
    parser.add_argument("--peer-wait-ms", type=float, default=PEER_WAIT_MS,
                        help="the stand-in wait for peers on a side stream after each step "
                             "(default %(default)s; 0: none)")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError as exc:
        print("gpu_timing_check: torch cannot be imported (%s); nothing checked" % exc)
        return 2
    if not torch.cuda.is_available():
        print("gpu_timing_check: no CUDA device is available here; this check needs one GPU "
              "(nothing was checked)")
        return 2
    print("gpu_timing_check (%s) on %s, torch %s"
          % (args.workload, torch.cuda.get_device_name(0), torch.__version__))
    small, large = sorted(args.sizes or WORKLOADS[args.workload][1])
    peer_wait = max(0.0, args.peer_wait_ms) / 1e3
    medians = {"n=%d" % n: measure(n, args.steps, args.warmup, args.repeats, args.workload,
                                   peer_wait) for n in (small, large)}
    passed, _, lines = verdict(medians, peer_wait=peer_wait)
    print("\n".join(lines))
    print("device_sync on an idle stream: %.1f us per call" % (1e6 * sync_cost()))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
