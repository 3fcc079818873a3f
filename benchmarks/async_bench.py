"""Asynchronous mode: does balancing batch sizes cut staleness and raise accuracy?

One run per process group, driven by run_async_bench.sh::

    mpirun -np 5 python benchmarks/async_bench.py run --variant async-omnihvd --level HL8 \\
        --budget 45 --out benchmarks/results/async/HL8-async-omnihvd-s0.json
    mpirun -np 4 python benchmarks/async_bench.py run --variant sync-omnihvd --level HL8 ...
    python benchmarks/async_bench.py report --inputs benchmarks/results/async

Variants (4 workers; the async ones add one parameter-server rank, rank 0):

  async-equal        parameter server, equal batches (B/4 each) for the whole run
  async-omnihvd      parameter server, omnihvd balancing of update intervals
  async-equal-slr    async-equal with the staleness-aware learning rate ("inverse")
  async-omnihvd-slr  async-omnihvd with the staleness-aware learning rate
  sync-omnihvd       synchronous Horovod with omnihvd.OmniLearnCallback

Every variant trains the same MLP (784-128-10) from the same seed with plain SGD
(same lr, global batch B; in async mode each push of b samples is weighted b/B) on
Fashion-MNIST for the same wall-time budget, with the workers' speeds emulated by
omnihvd.tools.emulate (model mode: a step on b samples takes b * sample_cost / speed, the
speeds being the paper's HL4 9/9/6/24 or HL8 6/6/4/32 cores / 12). The MLP keeps real
compute far below the emulated time even with 5 ranks on 2 cores, so the emulated
speeds hold (overruns are counted and reported). Then: test accuracy on the 10,000
test images, and the staleness of every update (async) with its median, p95, max.

``report`` gathers the run files into one JSON, a Markdown table and a plot of the
staleness distributions.
"""
import argparse
import glob
import json
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("async-equal", "async-omnihvd", "async-equal-slr", "async-omnihvd-slr",
            "sync-omnihvd")
WORKERS = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="one training run (under mpirun)")
    r.add_argument("--variant", required=True, choices=VARIANTS)
    r.add_argument("--level", default="HL8", help="HL1, HL2, HL4 or HL8 (omnihvd.tools.emulate)")
    r.add_argument("--budget", type=float, default=45.0, help="training wall time, seconds")
    r.add_argument("--batch-size", type=int, default=256, help="global batch B")
    r.add_argument("--lr", type=float, default=0.1)
    r.add_argument("--sample-cost", default="1ms", help="emulated seconds per sample at speed 1")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", required=True, help="JSON file for this run's results")
    s = sub.add_parser("report", help="merge run files; table, JSON and plot")
    s.add_argument("--inputs", default=os.path.join(HERE, "results", "async"))
    s.add_argument("--json", default=os.path.join(HERE, "results", "async_bench.json"))
    s.add_argument("--plot", default=os.path.join(HERE, "results", "async_staleness.png"))
    return p.parse_args(argv)


def build_mlp(seed):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 10))


def accuracy(model, x, y):
    import torch

    model.eval()
    with torch.no_grad():
        correct = int((model(x).argmax(1) == y).sum())
    model.train()
    return correct / len(y)


# ------------------------------------------------------------------ async runs


def run_async(args):
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI

    from omnihvd.tools import emulate, harness
    from omnihvd.asynchronous import AsyncBatchSampler, AsyncOmniLearnCallback, summarize_staleness
    from omnihvd.tools.data import load_fashion_mnist

    world = MPI.COMM_WORLD
    if world.Get_size() != WORKERS + 1:
        raise SystemExit("async variants need %d ranks (1 server + %d workers)"
                         % (WORKERS + 1, WORKERS))
    torch.set_num_threads(1)
    model = build_mlp(args.seed)
    cb = AsyncOmniLearnCallback(model, global_batch_size=args.batch_size, lr=args.lr,
                                num_servers=1, balance="omnihvd" in args.variant,
                                staleness_lr="inverse" if args.variant.endswith("-slr") else None)
    mine = {}
    if cb.is_worker:
        x, y = load_fashion_mnist("train")
        emu = emulate.Emulator(args.level, cb.worker_index, sample_cost=args.sample_cost)
        sampler = AsyncBatchSampler(len(x), cb, seed=args.seed)
    world.Barrier()
    start = time.perf_counter()
    with cb:
        if cb.is_server:
            report = cb.serve()
        else:
            samples = 0
            def late(step):  # each worker stops on its own clock: no agreement needed
                return time.perf_counter() - start >= args.budget

            with harness.steps(cb, sampler, emulator=emu, stop=late) as run:
                for step in run:
                    idx = torch.as_tensor(step.batch)
                    model.zero_grad()
                    F.cross_entropy(model(x[idx]), y[idx]).backward()
                    step.compute_done()
                    samples += step.size   # the loop's cb.on_batch_end() pushes the gradient
                trained = time.perf_counter() - start
            mine = {"pushes": cb.step, "samples": samples, "train_s": trained,
                    "emu": emu.stats(), "sizes": [h["batch_size"] for h in cb.history]}
            if cb.worker_index == 0:
                tx, ty = load_fashion_mnist("test")
                mine["accuracy"] = accuracy(model, tx, ty)
    gathered = world.gather(mine, root=0)
    if cb.rank != 0:
        return
    workers = gathered[1:]
    log = report["log"]
    staleness = np.array(log["staleness"])
    who = np.array(log["worker"]) - 1
    per_worker = [summarize_staleness(staleness[who == w]) for w in range(WORKERS)]
    record = {
        "accuracy": workers[0]["accuracy"], "updates": report["updates"],
        "pushes": [w["pushes"] for w in workers], "samples": [w["samples"] for w in workers],
        "train_s": max(w["train_s"] for w in workers),
        "staleness": report["staleness"], "staleness_per_worker": per_worker,
        "staleness_values": staleness.tolist(), "update_worker": who.tolist(),
        "update_time": log["time"], "update_batch": log["batch_size"], "lr_scale": log["scale"],
        "final_batch_sizes": report["batch_sizes"], "decisions": report["decisions"],
        "emulator": [w["emu"] for w in workers],
    }
    write(args, record)


# ------------------------------------------------------------------- sync run


def run_sync(args):
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    import omnihvd
    from omnihvd.tools import emulate, harness
    from omnihvd.tools.data import load_fashion_mnist

    hvd.init()
    if hvd.size() != WORKERS:
        raise SystemExit("sync-omnihvd needs %d ranks" % WORKERS)
    torch.set_num_threads(1)
    if not hasattr(omnihvd, "OmniLearnCallback"):
        raise SystemExit("omnihvd.OmniLearnCallback is missing: cannot run sync-omnihvd")
    model = build_mlp(args.seed)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                   named_parameters=model.named_parameters())
    cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=args.batch_size)
    x, y = load_fashion_mnist("train")
    sampler = omnihvd.HeterogeneousBatchSampler(len(x), cb, seed=args.seed)
    emu = emulate.Emulator(args.level, hvd.rank(), sample_cost=args.sample_cost)

    def stop(step):  # every rank must stop at the same step: agree on it every 5 steps
        if (step.index + 1) % 5:
            return False
        late = float(time.perf_counter() - start >= args.budget)
        return hvd.allreduce(torch.tensor([late]), op=hvd.Max, name="stop").item() > 0

    samples = 0
    with harness.steps(cb, sampler, emulator=emu, stop=stop) as run:
        hvd.allreduce(torch.zeros(1), name="start")
        start = time.perf_counter()
        for step in run:
            idx = torch.as_tensor(step.batch)
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            step.compute_done()
            opt.step()
            samples += step.size
        trained = time.perf_counter() - start
    steps = run.step
    mine = {"samples": samples, "emu": emu.stats(), "sizes": list(cb.batch_sizes)}
    gathered = hvd.allgather_object(mine)
    if hvd.rank() == 0:
        tx, ty = load_fashion_mnist("test")
        zero = {"count": steps * WORKERS, "median": 0.0, "p95": 0.0, "max": 0, "mean": 0.0}
        write(args, {"accuracy": accuracy(model, tx, ty), "updates": steps,
                     "pushes": [steps] * WORKERS, "samples": [g["samples"] for g in gathered],
                     "train_s": trained, "staleness": zero, "staleness_per_worker": [zero] * WORKERS,
                     "final_batch_sizes": gathered[0]["sizes"],
                     "adjustments": sum(1 for h in cb.history if h.get("changed")),
                     "emulator": [g["emu"] for g in gathered]})


def write(args, record):
    record.update(variant=args.variant, level=args.level, seed=args.seed, budget_s=args.budget,
                  batch_size=args.batch_size, lr=args.lr, sample_cost=args.sample_cost,
                  host=platform.node(), cpus=os.cpu_count(),
                  finished=time.strftime("%Y-%m-%dT%H:%M:%S"))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f)
    print("%s %s seed %d: accuracy %.4f, updates %d, staleness %s, final sizes %s"
          % (args.level, args.variant, args.seed, record["accuracy"], record["updates"],
             {k: record["staleness"][k] for k in ("median", "p95", "max")},
             record["final_batch_sizes"]), flush=True)


# --------------------------------------------------------------------- report


def report(args):
    runs = []
    for path in sorted(glob.glob(os.path.join(args.inputs, "*.json"))):
        with open(path) as f:
            runs.append(json.load(f))
    if not runs:
        raise SystemExit("no run files in %s; run benchmarks/run_async_bench.sh first" % args.inputs)
    rows = []
    for level in sorted({r["level"] for r in runs}):
        for variant in VARIANTS:
            group = [r for r in runs if r["level"] == level and r["variant"] == variant]
            if not group:
                continue
            acc = [r["accuracy"] for r in group]
            stale = np.concatenate([_staleness(r) for r in group])
            # Second half of each run: after the balancer has converged.
            late = np.concatenate([_staleness(r)[len(_staleness(r)) // 2:] for r in group])
            pushes = np.array([r["pushes"] for r in group], dtype=float).mean(axis=0)
            overruns = sum(e["overruns"] for r in group for e in r["emulator"])
            steps = sum(e["steps"] for r in group for e in r["emulator"])
            rows.append({
                "level": level, "variant": variant, "runs": len(group),
                "seeds": [r["seed"] for r in group],
                "accuracy_mean": float(np.mean(acc)), "accuracy": acc,
                "accuracy_min": float(np.min(acc)), "accuracy_max": float(np.max(acc)),
                "updates": float(np.mean([r["updates"] for r in group])),
                "pushes_per_worker": pushes.round(1).tolist(),
                "samples": float(np.mean([sum(r["samples"]) for r in group])),
                "staleness_median": float(np.median(stale)) if stale.size else None,
                "staleness_p95": float(np.percentile(stale, 95)) if stale.size else None,
                "staleness_max": int(stale.max()) if stale.size else None,
                "staleness_mean": float(stale.mean()) if stale.size else None,
                "staleness_histogram": np.bincount(stale.astype(int)).tolist() if stale.size else [],
                "late_staleness_p95": float(np.percentile(late, 95)) if late.size else None,
                "late_staleness_max": int(late.max()) if late.size else None,
                "staleness_per_worker": [r["staleness_per_worker"] for r in group],
                "final_batch_sizes": [r["final_batch_sizes"] for r in group],
                "budget_s": group[0]["budget_s"], "emulator_overruns": f"{overruns}/{steps}",
            })
    summary = {"rows": rows, "runs": [{k: v for k, v in r.items() if k not in (
        "staleness_values", "update_worker", "update_time", "update_batch", "lr_scale")}
        for r in runs]}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(summary, f, indent=1)
    print(markdown(rows))
    if args.plot:
        plot(runs, args.plot)
        print("\nplot: %s" % args.plot)
    print("json: %s" % args.json)


def _staleness(run):
    """Every update's staleness (sync runs: zeros, one per worker gradient)."""
    return np.asarray(run.get("staleness_values", [0] * run["staleness"]["count"]), dtype=float)


def markdown(rows):
    head = ("| level | variant | runs | test accuracy (mean; min-max) | samples | pushes per "
            "worker | staleness median / p95 / max | 2nd half p95 / max | final batch sizes |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append("| %s | %s | %d | %.4f; %.4f-%.4f | %.0f | %s | %s / %s / %s | %s / %s | %s |" % (
            r["level"], r["variant"], r["runs"], r["accuracy_mean"], r["accuracy_min"],
            r["accuracy_max"], r["samples"], "/".join("%.0f" % p for p in r["pushes_per_worker"]),
            _fmt(r["staleness_median"]), _fmt(r["staleness_p95"]), _fmt(r["staleness_max"]),
            _fmt(r["late_staleness_p95"]), _fmt(r["late_staleness_max"]),
            r["final_batch_sizes"][0]))
    return "\n".join(lines)


def _fmt(v):
    return "-" if v is None else ("%g" % v)


def plot(runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({r["level"] for r in runs})
    variants = [v for v in VARIANTS if v.startswith("async") and
                any(r["variant"] == v for r in runs)]
    fig, axes = plt.subplots(1, len(levels), figsize=(6 * len(levels), 4), squeeze=False)
    for ax, level in zip(axes[0], levels):
        right = 0
        for variant in variants:
            values = np.concatenate([r["staleness_values"] for r in runs
                                     if r["level"] == level and r["variant"] == variant])
            if values.size == 0:
                continue
            top = int(values.max())
            counts = np.bincount(values.astype(int), minlength=top + 1) / values.size
            ax.step(np.arange(top + 1), counts, where="mid", label="%s (p95 %g, max %d)" % (
                variant, np.percentile(values, 95), top))
            right = max(right, np.percentile(values, 99.9))
        # A rare straggler (one update thousands of ms late) would squash the plot;
        # its value is in the legend.
        ax.set_xlim(-0.5, right + 2.5)
        ax.set_title("%s: staleness of every update" % level)
        ax.set_xlabel("staleness (server versions behind)")
        ax.set_ylabel("fraction of updates")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None):
    args = parse_args(argv)
    if args.command == "report":
        report(args)
    elif args.variant.startswith("async"):
        run_async(args)
    else:
        run_sync(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
