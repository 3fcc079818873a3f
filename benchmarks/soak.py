"""Fault and load test: thousands of omnihvd steps through changing heterogeneity,
injected slow steps, one rank failure, and a resume from the last checkpoint.

    bash benchmarks/run_soak.sh             # the driver; a few minutes on 2 cores
    bash benchmarks/run_soak.sh --period 100 --steps 700    # any option below

The driver (this script without ``worker``) runs two ``mpirun -np RANKS`` jobs of
``soak.py worker`` and then reports:

1. From scratch. A small MLP learns the 10,000 Fashion-MNIST test images with
   OmniLearnCallback + HeterogeneousBatchSampler. Heterogeneity is emulated
   (omnihvd.tools.emulate, model mode: a step of b samples takes ``(step_cost + b *
   sample_cost) / speed``) and changes every ``--period`` steps through the paper's
   HL1-HL2-HL4-HL8-HL4-HL2-HL1. About one step in ``--slow-every`` is made 20-100x
   slower on a random rank (it sleeps: a GC pause, a stalled disk). Rank 0 writes
   the user's checkpoint (model, optimizer, callback, sampler) every
   ``--checkpoint-every`` steps. At step ``--fail-step`` rank ``--fail-rank`` raises;
   omnihvd's abort-on-exception must end the whole job, non-zero, within
   ``--exit-bound`` seconds.
2. Resume. A new job loads the last checkpoint and trains to ``--steps``.

What it reports (printed, and written as JSON to ``--out``): steps run, lost and
replayed; the failure's exit code, message and seconds to exit; size adjustments;
per heterogeneity phase the steps until the split is balanced again (its
noise-free step time, computed from the emulated speeds, within 10% of the best
integer split's) and the share of the phase spent balanced; for the decisions
whose timing window held a slow step, the slowed rank's window time against its
emulated step time (what the median let through); measured step times; and
sample coverage across the
crash: every epoch uses each sample at most once, complete epochs use exactly
``N - N mod B`` samples, at the same positions of the epoch's order as without
a crash.

Every rank logs each step (sizes, its sample indices, loss) as JSON lines in the
work folder; the report keeps the records the checkpoint covers from job 1 and
the rest from job 2, as a real resumed run would.
"""
import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DATASET_SIZE = 10000  # Fashion-MNIST test split
# A split counts as balanced when its emulated step time is within 10% of the best
# integer split's: at B=64 one sample on the slowest HL8 rank is worth about 15%.
BALANCED = 1 / 1.1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("role", nargs="?", choices=("driver", "worker"), default="driver",
                   help="driver (default): run both jobs and report; worker: one job, "
                        "under mpirun")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--period", type=int, default=300, help="steps per heterogeneity level")
    p.add_argument("--steps", type=int, default=None,
                   help="steps in all (default: 7 periods, the whole dynamic schedule)")
    p.add_argument("--batch-size", type=int, default=64, help="global batch B")
    p.add_argument("--adjust-every", type=int, default=20)
    p.add_argument("--sample-cost", type=float, default=0.002,
                   help="emulated seconds per sample at speed 1")
    p.add_argument("--step-cost", type=float, default=0.004,
                   help="emulated fixed seconds per step at speed 1")
    p.add_argument("--slow-every", type=int, default=100,
                   help="one injected slow step per this many steps, on average")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--fail-rank", type=int, default=2)
    p.add_argument("--fail-step", type=int, default=None,
                   help="global step at which --fail-rank raises (default: 55%% of --steps)")
    p.add_argument("--exit-bound", type=float, default=60.0,
                   help="seconds the failed job may take to exit before it counts as hung")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(HERE, "results", "soak.json"))
    p.add_argument("--workdir", default=None,
                   help="folder for logs and checkpoints (default: a temporary one, removed)")
    p.add_argument("--resume", action="store_true", help="worker: start from the checkpoint")
    p.add_argument("--job", type=int, default=1, help="worker: job number, names its logs")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 7 * args.period
    if args.fail_step is None:
        args.fail_step = int(0.55 * args.steps) + args.checkpoint_every // 3
    if not 0 < args.fail_step < args.steps:
        p.error("--fail-step must lie inside the run (0 < %d < %d)" % (args.fail_step, args.steps))
    if not 0 <= args.fail_rank < args.ranks:
        p.error("--fail-rank must be a rank of the job (0..%d)" % (args.ranks - 1))
    return args


def schedule_text(period):
    return "dynamic:%d" % period


def slow_steps(args):
    """{step: (rank, factor)}: the injected slow steps, the same on every rank."""
    rng = np.random.default_rng(args.seed)
    count = max(args.steps // args.slow_every, 1)
    steps = rng.choice(np.arange(10, args.steps), size=count, replace=False)
    ranks = rng.integers(0, args.ranks, size=count)
    factors = rng.uniform(20, 100, size=count)
    return {int(s): (int(r), float(f)) for s, r, f in zip(steps, ranks, factors)
            if s != args.fail_step}


# ---------------------------------------------------------------- worker


def worker(args):
    import torch
    import horovod.torch as hvd

    import omnihvd
    from omnihvd.tools.data import load_fashion_mnist
    from omnihvd.tools import harness
    from omnihvd.tools.emulate import Emulator

    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    if hvd.size() != args.ranks:
        raise SystemExit("soak.py worker: started on %d ranks but --ranks is %d"
                         % (hvd.size(), args.ranks))
    x, y = load_fashion_mnist("test")
    dataset = torch.utils.data.TensorDataset(x, y, torch.arange(len(y)))
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=args.batch_size,
                                   adjust_every=args.adjust_every)
    sampler = omnihvd.HeterogeneousBatchSampler(len(dataset), cb, seed=args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    emu = Emulator(schedule_text(args.period), rank, sample_cost=args.sample_cost,
                   step_cost=args.step_cost)
    checkpoint = os.path.join(args.workdir, "checkpoint.pt")
    if args.resume:
        state = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        cb.load_state_dict(state["omnihvd"])
        sampler.load_state_dict(state["sampler"])
    slow = slow_steps(args)
    log = open(os.path.join(args.workdir, "job%d-rank%d.jsonl" % (args.job, rank)), "w")

    # resumed: the loop goes on from the checkpoint's step and epoch
    with harness.steps(cb, sampler, loader, max_steps=args.steps, emulator=emu,
                       first_step=cb.step, first_epoch=sampler.epoch,
                       size=lambda batch: len(batch[2])) as run:
        for step in run:
            xb, yb, idx = step.batch
            sizes = cb.batch_sizes_at(step.index)
            if step.index == args.fail_step and rank == args.fail_rank and not args.resume:
                # before backward, whose hooks would already send this step's gradients
                print("SOAK-FAIL rank %d step %d" % (rank, step.index), flush=True)
                raise RuntimeError("soak: injected failure on rank %d at step %d"
                                   % (rank, step.index))
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            step.compute_done()
            if slow.get(step.index, (None,))[0] == rank:
                with cb.working():   # a pause in this rank's own work, not a wait
                    time.sleep((slow[step.index][1] - 1) * emu.target(len(idx), 0.0))
            opt.step()
            last = cb.history[-1] if cb.history else None  # the history is bounded:
            step.end()                                       # compare records, not lengths
            record = {"k": "step", "step": step.index, "epoch": step.epoch, "sizes": sizes,
                      "idx": idx.tolist(), "loss": float(loss)}
            if rank == 0:  # the step time (every rank leaves the allreduce together)
                record["wall_s"] = step.t_end - step.t_begin
                if cb.history and cb.history[-1] is not last:  # at most one per step
                    log.write(json.dumps(dict(cb.history[-1], k="decision")) + "\n")
            log.write(json.dumps(record) + "\n")
            log.flush()
            if cb.step % args.checkpoint_every == 0 and cb.step < args.steps:
                save_checkpoint(checkpoint, model, opt, cb, sampler, rank)
    log.write(json.dumps({"k": "end", "step": cb.step, "emulator": emu.stats(),
                          "overhead_per_step_s": cb.overhead_per_step}) + "\n")
    log.close()


def save_checkpoint(path, model, opt, cb, sampler, rank):
    import torch

    if rank != 0:
        return
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
             "omnihvd": cb.state_dict(), "sampler": sampler.state_dict()}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # a crash never leaves half a checkpoint


# ---------------------------------------------------------------- driver


def run_job(cmd, exit_bound, timeout):
    """Run one mpirun job; returns (exit code, output, seconds from SOAK-FAIL to exit, wall).

    A job still alive ``exit_bound`` seconds after its SOAK-FAIL line (or ``timeout``
    seconds in all) is killed with its whole session and reported as hung (exit None).
    """
    begin = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines, failed_at = [], []

    def read():
        for line in proc.stdout:
            lines.append(line)
            sys.stdout.write(line if "SOAK-FAIL" in line or "omnihvd: rank" in line else "")
            if "SOAK-FAIL" in line and not failed_at:
                failed_at.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    hung = False
    while proc.poll() is None:
        now = time.monotonic()
        if now - begin > timeout or (failed_at and now - failed_at[0] > exit_bound):
            os.killpg(proc.pid, signal.SIGKILL)  # mpirun leads the session's process group
            hung = True
            proc.wait()
            break
        time.sleep(0.05)
    ended = time.monotonic()
    reader.join(10)
    to_exit = ended - failed_at[0] if failed_at else None
    return (None if hung else proc.returncode), "".join(lines), to_exit, ended - begin


def read_logs(workdir, job, ranks):
    steps = [dict() for _ in range(ranks)]
    decisions, ends = [], []
    for rank in range(ranks):
        path = os.path.join(workdir, "job%d-rank%d.jsonl" % (job, rank))
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:  # the last line of a killed job may be cut short
                    continue
                if record["k"] == "step":
                    steps[rank][record["step"]] = record
                elif record["k"] == "decision":
                    decisions.append(record)
                elif record["k"] == "end":
                    ends.append(record)
    return steps, decisions, ends


def best_split_time(speeds, batch, step_cost, sample_cost):
    """The emulated step time of the best integer split (greedy water-filling is exact
    for this min-max problem: each rank's time grows with its batch)."""
    speeds = np.asarray(speeds, dtype=float)
    sizes = np.ones(len(speeds), dtype=int)
    for _ in range(batch - len(speeds)):
        sizes[np.argmin((step_cost + (sizes + 1) * sample_cost) / speeds)] += 1
    return float(np.max((step_cost + sizes * sample_cost) / speeds))


def efficiency(sizes, speeds, best, step_cost, sample_cost):
    """Noise-free balance of a split: best split's step time / this split's."""
    return best / float(np.max((step_cost + np.asarray(sizes) * sample_cost) / np.asarray(speeds)))


def analyse(args, checkpoint_step, job1, job2):
    from omnihvd.tools.emulate import parse_schedule
    from omnihvd.sampler import HeterogeneousBatchSampler, StaticSchedule

    B, A, S = args.batch_size, args.adjust_every, args.steps
    steps1, decisions1, _ = read_logs(args.workdir, 1, args.ranks)
    steps2, decisions2, ends = read_logs(args.workdir, 2, args.ranks)
    problems = []

    # the run as the resumed job sees it: job 1 up to the checkpoint, then job 2
    table = {}
    for rank in range(args.ranks):
        merged = {s: r for s, r in steps1[rank].items() if s < checkpoint_step}
        overlap = set(merged) & set(steps2[rank])
        if overlap:
            problems.append("rank %d: job 2 re-ran steps %s before the checkpoint" % (rank, sorted(overlap)[:5]))
        merged.update(steps2[rank])
        for s, r in merged.items():
            row = table.setdefault(s, {"epoch": r["epoch"], "sizes": r["sizes"], "idx": {}})
            if (row["epoch"], row["sizes"]) != (r["epoch"], r["sizes"]):
                problems.append("step %d: ranks disagree on epoch or sizes" % s)
            row["idx"][rank] = r["idx"]
            if rank == 0:
                row["loss"], row["wall_s"] = r["loss"], r.get("wall_s")
    missing = sorted(set(range(S)) - set(table))
    if missing:
        problems.append("steps never run: %s..." % missing[:5])

    # coverage against each epoch's global order
    N = DATASET_SIZE
    per_epoch = N // B
    order_of = {}
    positions = {}
    for s in sorted(table):
        row = table[s]
        e = row["epoch"]
        positions.setdefault(e, []).append(s)
        if e not in order_of:
            sampler = HeterogeneousBatchSampler(N, StaticSchedule([B]), seed=args.seed)
            sampler.set_epoch(e)
            order_of[e] = sampler.order().tolist()
    wrong_position = repeated = skipped = 0
    epochs_complete = 0
    for e, ss in positions.items():
        used = []
        for s in ss:
            row, j = table[s], s - ss[0]  # the epoch's j-th step
            sizes = row["sizes"]
            if sum(sizes) != B:
                problems.append("step %d: sizes %s do not sum to %d" % (s, sizes, B))
            for rank, got in sorted(row["idx"].items()):
                lo = j * B + sum(sizes[:rank])
                wrong_position += got != order_of[e][lo:lo + sizes[rank]]
                used.extend(got)
        repeated += len(used) - len(set(used))
        if len(ss) == per_epoch:
            epochs_complete += 1
            skipped += len(set(order_of[e][:per_epoch * B]) - set(used))
    coverage = {"dataset": N, "global_batch": B, "steps_per_epoch": per_epoch,
                "epochs_complete": epochs_complete,
                "epochs_partial": len(positions) - epochs_complete,
                "samples_used": sum(len(i) for row in table.values() for i in row["idx"].values()),
                "repeated_within_an_epoch": repeated, "skipped_in_complete_epochs": skipped,
                "batches_off_their_epoch_position": int(wrong_position)}

    # balance per heterogeneity phase (noise-free, from the emulated speeds)
    schedule = parse_schedule(schedule_text(args.period))
    segments = [(seg.step, nxt.step if nxt else S, seg.speeds, seg.label)
                for seg, nxt in zip(schedule.segments, list(schedule.segments[1:]) + [None])
                if seg.step < S]
    phases = []
    for start, end, speeds, label in segments:
        best = best_split_time(speeds, B, args.step_cost, args.sample_cost)
        rows = [table[s] for s in range(start, min(end, S)) if s in table]
        eff = [efficiency(r["sizes"], speeds, best, args.step_cost, args.sample_cost) for r in rows]
        balanced = [e >= BALANCED for e in eff]
        reach = balanced.index(True) if True in balanced else None
        walls = [r["wall_s"] for r in rows if r.get("wall_s") is not None]
        phases.append({
            "level": label, "start": start, "end": min(end, S),
            "adjustments": sum(1 for a, b in zip(rows, rows[1:]) if a["sizes"] != b["sizes"]),
            "steps_to_balance": reach, "balanced_share": float(np.mean(balanced)) if rows else None,
            "efficiency_first": eff[0] if eff else None,
            "efficiency_last_quarter": float(np.mean(eff[-max(len(eff) // 4, 1):])) if eff else None,
            "final_sizes": rows[-1]["sizes"] if rows else None,
            "best_emulated_step_ms": 1000 * best,
            "measured_step_ms_median": 1000 * float(np.median(walls)) if walls else None,
        })

    # decisions, and those whose timing window held an injected slow step
    decisions = [d for d in decisions1 if d["step"] <= checkpoint_step] + decisions2
    slow = slow_steps(args)
    changes = schedule.changes
    kinds = {"with_slow_step": [0, 0, 0], "quiet": [0, 0, 0]}  # decisions, changed, worse
    ratios = {"slowed": [], "others": []}  # window time / emulated step time
    windows = []  # per decision with a slow step: the slowed rank's view of it
    moved = []
    for d in decisions:
        window = range(d["step"] - 1 - A, d["step"] - 1)
        if any(c in window or c == d["step"] - 1 for c in changes):
            continue  # the speeds changed under this window: a move is expected
        speeds = schedule.speeds_at(d["step"] - 2)
        slowed = {slow[s][0] for s in window if s in slow}
        for rank, (b, t) in enumerate(zip(d["sizes"], d["times"])):
            emulated = (args.step_cost + b * args.sample_cost) / speeds[rank]
            if t == t:  # NaN: no valid sample in the window
                ratios["slowed" if rank in slowed else "others"].append(t / emulated)
            if rank in slowed:
                windows.append({"decision_step": d["step"], "rank": rank,
                                "slow_steps": [[s, round(slow[s][1], 1)] for s in window
                                               if slow.get(s, (None,))[0] == rank],
                                "samples": d["samples"][rank], "time_over_emulated": t / emulated,
                                "changed": d["changed"]})
        kind = "with_slow_step" if slowed else "quiet"
        kinds[kind][0] += 1
        if d["changed"]:
            kinds[kind][1] += 1
            moved.append(max(abs(a - b) for a, b in zip(d["sizes"], d["new_sizes"])))
            speeds = schedule.speeds_at(d["effective_step"])
            best = best_split_time(speeds, B, args.step_cost, args.sample_cost)
            before = efficiency(d["sizes"], speeds, best, args.step_cost, args.sample_cost)
            after = efficiency(d["new_sizes"], speeds, best, args.step_cost, args.sample_cost)
            kinds[kind][2] += after < before - 0.02
    injected = {s: v for s, v in slow.items() if s < S}
    slow_report = {"injected": len(injected),
                   "factors": [round(min(v[1] for v in injected.values()), 1),
                               round(max(v[1] for v in injected.values()), 1)] if injected else None}
    for kind, (count, changed, worse) in kinds.items():
        slow_report["decisions_" + kind] = count
        slow_report["changed_" + kind] = changed
        slow_report["changed_to_a_worse_split_" + kind] = worse
    for who, values in ratios.items():
        slow_report["window_time_over_emulated_" + who] = {
            "median": float(np.median(values)), "max": float(np.max(values))} if values else None
    slow_report["largest_move_per_change_samples_median"] = float(np.median(moved)) if moved else None
    slow_report["windows"] = windows

    losses = [table[s]["loss"] for s in sorted(table)]
    overruns = sum(e["emulator"]["overruns"] for e in ends)
    emulated = sum(e["emulator"]["steps"] for e in ends)
    return {
        "steps": {"planned": S, "run_in_job1": max(steps1[0]) + 1 if steps1[0] else 0,
                  "checkpoint": checkpoint_step,
                  "lost_and_replayed": args.fail_step - checkpoint_step,
                  "run_in_job2": len(steps2[0]), "in_final_run": len(table)},
        "adjustments": sum(1 for d in decisions if d["changed"]),
        "decisions": len(decisions),
        "phases": phases,
        "slow_steps": slow_report,
        "coverage": coverage,
        "loss": {"first_100_mean": float(np.mean(losses[:100])),
                 "last_100_mean": float(np.mean(losses[-100:]))},
        "emulation_overruns_job2": "%d of %d rank-steps" % (overruns, emulated),
        "callback_overhead_ms_per_step_job2": 1000 * float(np.mean(
            [e["overhead_per_step_s"] for e in ends])) if ends else None,
        "problems": problems,
    }


def driver(args):
    import torch

    own_workdir = args.workdir is None
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="omnihvd-soak-")
    os.makedirs(args.workdir, exist_ok=True)
    base = ["mpirun", "-np", str(args.ranks), "--oversubscribe", "--bind-to", "none",
            sys.executable, os.path.abspath(__file__), "worker"]
    options = ["--ranks", args.ranks, "--period", args.period, "--steps", args.steps,
               "--batch-size", args.batch_size, "--adjust-every", args.adjust_every,
               "--sample-cost", args.sample_cost, "--step-cost", args.step_cost,
               "--slow-every", args.slow_every, "--checkpoint-every", args.checkpoint_every,
               "--fail-rank", args.fail_rank, "--fail-step", args.fail_step,
               "--seed", args.seed, "--workdir", args.workdir]
    options = [str(o) for o in options]
    timeout = 30 * 60
    print("soak: job 1, %d ranks, %d steps planned, rank %d fails at step %d (work folder %s)"
          % (args.ranks, args.steps, args.fail_rank, args.fail_step, args.workdir), flush=True)
    rc1, out1, to_exit, wall1 = run_job(base + options + ["--job", "1"], args.exit_bound, timeout)
    message = [l.strip() for l in out1.splitlines() if "omnihvd: rank %d raised" % args.fail_rank in l]
    failure = {"rank": args.fail_rank, "step": args.fail_step, "exit_code": rc1,
               "hung": rc1 is None, "seconds_from_raise_to_exit": to_exit,
               "message": message[0] if message else None,
               "mpi_abort_names_the_rank": "MPI_ABORT was invoked on rank %d" % args.fail_rank in out1}
    print("soak: job 1 ended: exit %s, %.1f s after the failure" % (rc1, to_exit or float("nan")),
          flush=True)
    if rc1 in (0, None) or to_exit is None:
        print(out1[-4000:], file=sys.stderr)
        raise SystemExit("soak: job 1 did not fail as injected (exit %s)" % rc1)
    checkpoint_step = torch.load(os.path.join(args.workdir, "checkpoint.pt"),
                                 weights_only=False)["omnihvd"]["step"]
    print("soak: job 2 resumes from the checkpoint at step %d" % checkpoint_step, flush=True)
    rc2, out2, _, wall2 = run_job(base + options + ["--job", "2", "--resume"], args.exit_bound,
                                  timeout)
    if rc2 != 0:
        print(out2[-4000:], file=sys.stderr)
        raise SystemExit("soak: job 2 (resume) failed with exit %s" % rc2)

    report = {"command": "bash benchmarks/run_soak.sh " + " ".join(sys.argv[1:]),
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "load_average_at_end": os.getloadavg()},
              "config": {k: v for k, v in vars(args).items()
                         if k not in ("role", "resume", "job", "workdir", "out")},
              "schedule": schedule_text(args.period),
              "failure": failure,
              "wall_s": {"job1": wall1, "job2": wall2, "total": wall1 + wall2}}
    report.update(analyse(args, checkpoint_step, 1, 2))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print_report(report)
    print("soak: wrote %s" % args.out)
    if own_workdir:
        shutil.rmtree(args.workdir, ignore_errors=True)
    return 1 if report["problems"] else 0


def print_report(r):
    s, f, c, sl = r["steps"], r["failure"], r["coverage"], r["slow_steps"]
    print("\nsoak report (%s, %d ranks, B=%d)" % (r["schedule"], r["config"]["ranks"],
                                                  r["config"]["batch_size"]))
    print("  steps: %d planned; job 1 ran %d, failed at %d; checkpoint at %d (%d steps lost "
          "and replayed); job 2 ran %d; the final run has %d" % (
              s["planned"], s["run_in_job1"], f["step"], s["checkpoint"], s["lost_and_replayed"],
              s["run_in_job2"], s["in_final_run"]))
    print("  failure: rank %d raised; job exit %s %.2f s later; message: %s" % (
        f["rank"], f["exit_code"], f["seconds_from_raise_to_exit"], f["message"]))
    print("  adjustments: %d in %d decisions" % (r["adjustments"], r["decisions"]))
    for p in r["phases"]:
        print("    %-4s steps %5d-%-5d adjustments %2d, balanced after %s steps, balanced %3.0f%% "
              "of the phase, efficiency last quarter %.3f, step %.1f ms measured / %.1f ms best "
              "emulated, sizes %s" % (
                  p["level"], p["start"], p["end"], p["adjustments"], p["steps_to_balance"],
                  100 * p["balanced_share"], p["efficiency_last_quarter"],
                  p["measured_step_ms_median"] or float("nan"), p["best_emulated_step_ms"],
                  p["final_sizes"]))
    print("  slow steps: %d injected (%sx); decisions with one in their window: %d, of which "
          "changed %d, to a worse split %d; decisions without: %d, changed %d, worse %d "
          "(median move %s samples)" % (
              sl["injected"], "-".join(map(str, sl["factors"] or [])),
              sl["decisions_with_slow_step"], sl["changed_with_slow_step"],
              sl["changed_to_a_worse_split_with_slow_step"], sl["decisions_quiet"],
              sl["changed_quiet"], sl["changed_to_a_worse_split_quiet"],
              sl["largest_move_per_change_samples_median"]))
    for who in ("slowed", "others"):
        ratio = sl["window_time_over_emulated_" + who]
        if ratio:
            print("    window time / emulated step time, %s: median %.2f, max %.2f" % (
                "slowed rank" if who == "slowed" else "other ranks", ratio["median"], ratio["max"]))
    if sl["windows"]:
        worst = max(sl["windows"], key=lambda w: w["time_over_emulated"])
        print("    (the largest: decision at step %d, rank %d, %d samples in its window, slow "
              "steps %s)" % (worst["decision_step"], worst["rank"], worst["samples"],
                             worst["slow_steps"]))
    print("  coverage: %d complete epochs + %d partial; %d samples used; repeated %d, skipped "
          "%d, batches off their position %d" % (
              c["epochs_complete"], c["epochs_partial"], c["samples_used"],
              c["repeated_within_an_epoch"], c["skipped_in_complete_epochs"],
              c["batches_off_their_epoch_position"]))
    print("  loss: %.3f (first 100 steps) -> %.3f (last 100)" % (
        r["loss"]["first_100_mean"], r["loss"]["last_100_mean"]))
    print("  wall: job 1 %.0f s, job 2 %.0f s; emulation overruns (job 2): %s" % (
        r["wall_s"]["job1"], r["wall_s"]["job2"], r["emulation_overruns_job2"]))
    for problem in r["problems"]:
        print("  PROBLEM: " + problem)


def main(argv=None):
    args = parse_args(argv)
    if args.role == "worker":
        worker(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
