"""omnihvd vs plain Horovod vs the ideal, on emulated heterogeneous ranks.

Run under MPI (4 ranks for the paper's levels), e.g. through run_bench.sh::

    mpirun -np 4 python benchmarks/bench.py --name full

For every heterogeneity level it trains the same model from the same seed on
Fashion-MNIST, one after another:

  plain      plain Horovod: equal per-rank batches (DistributedSampler)
  omnihvd    omnihvd.OmniLearnCallback with its default options
  reference  the OmniLearn reference policy as an omnihvd configuration: adjust once
             per epoch, dead band 0.2, raw mean times, proportional control

and computes the ideal step time B / sum_i(x_i) from each rank's measured throughput
x_i = b_i / t_i. Per level it reports step times once converged, speed-ups,
efficiency (ideal / measured), adjustments and seconds to converge, and the
callback's overhead. ``--tta`` adds a time-to-accuracy run (plain vs omnihvd).

Output (rank 0): a table on the terminal, benchmarks/results/<name>.json, and per
level a run log per variant (<name>-<level>-<variant>.log, JSON lines) and PNG plots
(<name>-<level>-batch-sizes.png, <name>-<level>-step-time.png).
"""
import argparse
import json
import math
import os
import platform
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import horovod.torch as hvd
from omnihvd.tools import emulate, harness, telemetry
from omnihvd.tools.data import load_fashion_mnist
from omnihvd.tools.models import build_model

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("plain", "omnihvd", "reference")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default="bench", help="results/<name>.json and file prefix")
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="results folder")
    p.add_argument("--levels", default="HL1,HL2,HL4,HL8",
                   help="static levels, comma-separated ('' for none)")
    p.add_argument("--dynamic", default="dynamic:150",
                   help="schedule of the dynamic run ('' for none), e.g. 'dynamic:150' or "
                        "'0:HL1;200:HL8'")
    p.add_argument("--variants", default=",".join(VARIANTS), help="subset of " + ",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=200, help="steps per static run")
    p.add_argument("--reference-steps", type=int, default=None,
                   help="steps per static reference run (default: one epoch + steps/2, "
                        "since it adjusts once per epoch)")
    p.add_argument("--batch-size", type=int, default=256, help="global batch B")
    p.add_argument("--model", default="cnn", choices=("cnn", "resnet"))
    p.add_argument("--width", type=int, default=8, help="model width (channels of the first layer)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-limit", type=int, default=None, help="use the first N training images")
    p.add_argument("--cpu-plan", default="",
                   help="also run a level with REAL CPU heterogeneity, e.g. '0,1,1,1' "
                        "(rank 0 alone on CPU 0, ranks 1-3 sharing CPU 1); no emulation")
    p.add_argument("--tta", action=argparse.BooleanOptionalAction, default=False,
                   help="time to accuracy: plain vs omnihvd at --tta-level for --tta-epochs")
    p.add_argument("--tta-level", default="HL4")
    p.add_argument("--tta-epochs", type=int, default=3)
    p.add_argument("--tta-target", type=float, default=0.88)
    p.add_argument("--tta-seeds", default="0", help="comma-separated seeds (run-to-run noise)")
    p.add_argument("--eval-every", type=int, default=39, help="steps between test evaluations")
    p.add_argument("--check-emulation", action="store_true",
                   help="only measure how exactly each emulation mode reproduces the speeds "
                        "(plain Horovod, equal batches, every level in --levels)")
    p.add_argument("--progress", choices=("on", "off"), default="on")
    emulate.add_arguments(p)
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        p.error("unknown variants %s; choose from %s" % (unknown, ",".join(VARIANTS)))
    args.levels = [v.strip().upper() for v in args.levels.split(",") if v.strip()]
    for level in args.levels:
        emulate.level_speeds(level)   # validates
    return args


class Bench:
    """Data, model factory and training loop shared by every run (one per process)."""

    def __init__(self, args):
        self.args = args
        self.rank, self.size = hvd.rank(), hvd.size()
        self.x, self.y = load_fashion_mnist("train", limit=args.train_limit)
        tx, ty = load_fashion_mnist("test")
        self.test_x, self.test_y = tx[self.rank::self.size], ty[self.rank::self.size]
        self.B = args.batch_size
        if self.B % self.size:
            raise SystemExit("--batch-size %d must be divisible by the %d ranks (plain Horovod "
                             "splits it equally)" % (self.B, self.size))
        self.steps_per_epoch = len(self.x) // self.B
        self.show = self.rank == 0 and args.progress != "off"
        cost = args.emulate_sample_cost or os.environ.get(emulate.ENV["sample_cost"]) or "auto"
        self.sample_cost = None if cost == "auto" else emulate.parse_seconds(cost, "sample cost")
        self.step_cost = emulate.parse_seconds(args.emulate_step_cost or
                                               os.environ.get(emulate.ENV["step_cost"]) or 0)
        self.mode = args.emulate_mode or os.environ.get(emulate.ENV["mode"]) or "model"

    def calibrate(self, max_speed, margin=1.5, floor=1e-3, ceiling=4e-3, steps=12):
        """Choose the model-mode sample cost so real compute fits inside every target.

        All ranks train ``steps`` steps at equal batches, at once (the most CPU
        contention a run sees); p is the slowest rank's median seconds per sample. The
        fastest emulated rank needs ``sample_cost / max_speed > p``, so
        ``sample_cost = margin * p * max_speed``, rounded up to 0.25 ms, within
        [``floor``, ``ceiling``]: a machine so busy that it needs more would make the
        run take too long, and its overruns are reported instead.
        """
        rec = self.train("plain", None, steps, "calibrate")
        cost = None
        if self.rank == 0:
            per_sample = float(np.max(np.median(rec["local"][2:], axis=0)) / (self.B / self.size))
            wanted = math.ceil(margin * per_sample * max_speed / 2.5e-4) * 2.5e-4
            cost = min(max(floor, wanted), ceiling)
            print("calibration: %.3f ms of real compute per sample with all ranks busy -> "
                  "emulated sample cost %.2f ms at speed 1" % (per_sample * 1e3, cost * 1e3),
                  flush=True)
            if wanted > ceiling:
                print("warning: this machine is busy (%.2f ms per sample would be needed); "
                      "expect overruns, i.e. speed ratios less exact than scheduled"
                      % (wanted * 1e3), flush=True)
        self.sample_cost = hvd.broadcast_object(cost, root_rank=0, name="sample_cost")

    # ---------------------------------------------------------------- pieces

    def emulator(self, schedule):
        if schedule is None:
            return None
        return emulate.Emulator(schedule, self.rank, mode=self.mode,
                                sample_cost=self.sample_cost, step_cost=self.step_cost)

    def callback_options(self, variant):
        if variant == "reference":
            return dict(adjust_every=self.steps_per_epoch, deadband=0.2, timing="mean",
                        policy="proportional")
        return {}

    def evaluate(self, model):
        model.eval()
        with torch.no_grad():
            correct = (model(self.test_x).argmax(1) == self.test_y).sum().item()
        model.train()
        counts = hvd.allreduce(torch.tensor([correct, len(self.test_y)], dtype=torch.float64),
                               op=hvd.Sum, name="eval_counts")
        return float(counts[0] / counts[1])

    def plain_batches(self):
        """Plain Horovod's equal shards: (the sampler to set_epoch, its index batches)."""
        shard = torch.utils.data.DistributedSampler(
            range(len(self.x)), num_replicas=self.size, rank=self.rank, shuffle=True,
            seed=self.args.seed, drop_last=True)
        return shard, torch.utils.data.BatchSampler(shard, self.B // self.size, drop_last=True)

    # ---------------------------------------------------------------- one run

    def train(self, variant, schedule, steps, label, seed=None, eval_every=0):
        """Train from scratch for ``steps`` steps; returns rank 0's record (others: None)."""
        import omnihvd

        args = self.args
        seed = args.seed if seed is None else seed
        torch.manual_seed(seed)
        model = build_model(args.model, seed=seed, width=args.width)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        cb = None
        if variant != "plain":
            if not hasattr(omnihvd, "OmniLearnCallback"):
                raise SystemExit("omnihvd.OmniLearnCallback is missing: this omnihvd cannot run "
                                 "the %r variant; use --variants plain" % variant)
            cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=self.B,
                                           **self.callback_options(variant))
            sampler = batches = omnihvd.HeterogeneousBatchSampler(len(self.x), cb, seed=seed)
        else:
            sampler, batches = self.plain_batches()
        emu = self.emulator(schedule)
        bar = telemetry.ProgressBar(steps, label, enabled=self.show)
        sizes, local, hooks, step_s, clock, evals = [], [], [], [], [], []
        train_time = 0.0
        with harness.steps(cb, sampler, batches, max_steps=steps, emulator=emu) as run:
            hvd.allreduce(torch.zeros(1), name="barrier")
            for step in run:
                idx = torch.as_tensor(step.batch)
                opt.zero_grad()
                F.cross_entropy(model(self.x[idx]), self.y[idx]).backward()
                step.compute_done()
                opt.step()
                step.end()
                sizes.append(step.size)
                local.append(step.local_s)
                hooks.append(step.hook_s)
                step_s.append(step.step_s)
                train_time += step.step_s
                clock.append(train_time)
                if eval_every and (run.step % eval_every == 0 or run.step == steps):
                    evals.append({"step": run.step, "t": train_time,
                                  "accuracy": self.evaluate(model)})
                    run.restart_clock()   # evaluation time is not training time
                bar.update(step_s=float(np.median(step_s[-20:])),
                           **({"acc": "%.3f" % evals[-1]["accuracy"]} if evals else {}))
        # leaving the with block ran cb.on_train_end(): the callback's hooks are removed
        bar.close()
        mine = {"sizes": sizes, "local": local, "hooks": hooks,
                "emu": emu.stats() if emu is not None else None}
        gathered = hvd.allgather_object(mine)
        if self.rank != 0:
            return None
        return {"variant": variant, "label": label, "step_s": step_s, "t": clock, "evals": evals,
                "adjust_every": cb.adjust_every if cb is not None else None,
                "decisions": list(cb.history) if cb is not None else [],
                "sizes": np.array([g["sizes"] for g in gathered]).T,
                "local": np.array([g["local"] for g in gathered]).T,
                "hooks": np.array([g["hooks"] for g in gathered]).T,
                "emu": [g["emu"] for g in gathered]}


def write_log(path, record, meta):
    """Write one run's steps as a telemetry run log; return the step records."""
    with telemetry.RunLog(path, **meta) as log:
        for k in range(len(record["step_s"])):
            log.step(k, t=record["t"][k], step_s=record["step_s"][k], sizes=record["sizes"][k],
                     times=record["local"][k], hooks_s=float(record["hooks"][k].max()))
        for e in record["evals"]:
            log.event("eval", e["step"], t=e["t"], accuracy=e["accuracy"])
        for d in record.get("decisions", []):   # the callback's own record of each decision
            log.event("decision", d["step"], **{k: v for k, v in d.items() if k != "step"})
    return telemetry.read_log(path)["steps"]


def theoretical_speedup(speeds):
    """Plain step over ideal step when time is linear in samples: mean(speed) / min(speed)."""
    return float(np.mean(speeds) / np.min(speeds))


def run_level(bench, tag, schedule, level_name, cpu_plan=None):
    """All variants on one schedule; returns rank 0's result rows (one per segment)."""
    args = bench.args
    dynamic = len(schedule.segments) > 1
    results = {}
    for variant in args.variants:
        steps = args.steps if not dynamic else schedule.changes[-1] + \
            (schedule.changes[-1] - schedule.changes[-2] if len(schedule.changes) > 1 else args.steps)
        if variant == "reference" and not dynamic:
            steps = args.reference_steps or bench.steps_per_epoch + args.steps // 2
        label = "%-8s %-9s" % (tag, variant)
        results[variant] = bench.train(variant, None if cpu_plan else schedule, steps, label)
    if bench.rank != 0:
        return []
    segs, logs, overruns = {}, [], {}
    for variant, rec in results.items():
        meta = dict(run="%s %s" % (tag, variant), level=level_name, variant=variant,
                    schedule=str(schedule), changes=schedule.changes,
                    labels=[s.label for s in schedule.segments],
                    speeds=[list(s.speeds) for s in schedule.segments],
                    global_batch_size=bench.B, ranks=bench.size, model=args.model,
                    emulation=None if cpu_plan else dict(mode=bench.mode, sample_cost=bench.sample_cost,
                                                         step_cost=bench.step_cost),
                    cpu_plan=cpu_plan)
        path = os.path.join(args.out, "%s-%s-%s.log" % (args.name, tag, variant))
        steps = write_log(path, rec, meta)
        logs.append(path)
        segs[variant] = telemetry.summarize(steps, schedule.changes)
        overruns[variant] = sum(e["overruns"] for e in rec["emu"] if e) / rec["sizes"].size
    plots = telemetry.plot_logs(logs, args.out, "%s-%s" % (args.name, tag))
    rows = []
    for k, seg in enumerate(schedule.segments):
        def fig(variant, key):
            s = segs.get(variant)
            return s[k][key] if s and k < len(s) else None

        speeds = list(seg.speeds)
        ideal = fig("omnihvd", "ideal_s") or fig("plain", "ideal_s")
        row = {
            "level": seg.label if not dynamic else "%s[%d]:%s" % (tag, k, seg.label),
            "run": tag, "segment": k, "start_step": seg.step,
            "speeds": speeds if not cpu_plan else None, "cpu_plan": cpu_plan,
            "plain_step_s": fig("plain", "step_s"),
            "omnihvd_step_s": fig("omnihvd", "step_s"),
            "reference_step_s": fig("reference", "step_s"),
            "ideal_step_s": ideal,
            "sizes": fig("omnihvd", "sizes"),
            "adjustments_to_converge": fig("omnihvd", "adjustments_to_converge"),
            "steps_to_converge": fig("omnihvd", "steps_to_converge"),
            "seconds_to_converge": fig("omnihvd", "seconds_to_converge"),
            "reference_adjustments_to_converge": fig("reference", "adjustments_to_converge"),
            "reference_seconds_to_converge": fig("reference", "seconds_to_converge"),
            "overhead_per_step_s": fig("omnihvd", "hooks_s"),
            "overrun_fraction": overruns,
            "logs": [os.path.relpath(p, HERE) for p in logs],
            "plots": [os.path.relpath(p, HERE) for p in plots],
        }
        om, pl, ref = row["omnihvd_step_s"], row["plain_step_s"], row["reference_step_s"]
        row["efficiency"] = ideal / om if ideal and om else None
        row["reference_efficiency"] = ideal / ref if ideal and ref else None
        row["speedup"] = pl / om if pl and om else None
        row["reference_speedup"] = pl / ref if pl and ref else None
        row["theoretical_speedup"] = theoretical_speedup(speeds) if not cpu_plan else None
        row["speedup_fraction"] = (row["speedup"] / row["theoretical_speedup"]
                                   if row["speedup"] and row["theoretical_speedup"] else None)
        row["omnihvd_vs_reference"] = ref / om if ref and om else None
        every = results["omnihvd"]["adjust_every"] if "omnihvd" in results else None
        row["adjust_every"] = every
        row["reconverge_periods"] = (row["steps_to_converge"] / every
                                     if every and row["steps_to_converge"] is not None else None)
        row["overrun_pct"] = 100 * max(overruns.values()) if overruns and not cpu_plan else None
        row["time_per_epoch_s"] = {v: row[v + "_step_s"] * bench.steps_per_epoch
                                   for v in VARIANTS if row.get(v + "_step_s")}
        rows.append(row)
    return rows


def time_to_accuracy(bench):
    """Plain vs omnihvd at one level for a fixed number of epochs, per seed."""
    args = bench.args
    schedule = emulate.parse_schedule(args.tta_level, bench.size)
    steps = args.tta_epochs * bench.steps_per_epoch
    out, logs = [], []
    for seed in [int(s) for s in args.tta_seeds.split(",") if s.strip()]:
        for variant in ("plain", "omnihvd"):
            label = "tta s%d   %-9s" % (seed, variant)
            rec = bench.train(variant, schedule, steps, label, seed=seed,
                              eval_every=args.eval_every)
            if rec is None:
                continue
            reached = next((e for e in rec["evals"] if e["accuracy"] >= args.tta_target), None)
            path = os.path.join(args.out, "%s-tta-s%d-%s.log" % (args.name, seed, variant))
            write_log(path, rec, dict(run="%s seed %d" % (variant, seed), level=args.tta_level,
                                      variant=variant, changes=[], labels=[args.tta_level],
                                      target=args.tta_target))
            logs.append(path)
            out.append({"variant": variant, "seed": seed, "level": args.tta_level,
                        "epochs": args.tta_epochs, "target": args.tta_target,
                        "seconds_to_target": reached["t"] if reached else None,
                        "steps_to_target": reached["step"] if reached else None,
                        "final_accuracy": rec["evals"][-1]["accuracy"],
                        "train_seconds": rec["t"][-1],
                        "accuracy_curve": [(e["step"], round(e["t"], 3), round(e["accuracy"], 4))
                                           for e in rec["evals"]]})
    if logs:
        plots = telemetry.plot_logs(logs, args.out, "%s-tta" % args.name)
        for row in out:
            row["plots"] = [os.path.relpath(p, HERE) for p in plots]
    return out


def check_emulation(bench):
    """Plain Horovod with equal batches under each emulation mode: measured per-rank
    throughput shares against the scheduled speed shares."""
    args, rows = bench.args, []
    for level in args.levels:
        schedule = emulate.parse_schedule(level, bench.size)
        target = np.array(schedule.speeds_at(0)) / sum(schedule.speeds_at(0))
        for mode in emulate.MODES:
            bench.mode = mode
            rec = bench.train("plain", schedule, args.steps, "%-5s %-7s" % (level, mode))
            if rec is None:
                continue
            local = np.median(rec["local"][3:], axis=0)
            rate = np.median(rec["sizes"][3:], axis=0) / local
            share = rate / rate.sum()
            rows.append({"level": level, "mode": mode,
                         "target_share": [round(float(v), 4) for v in target],
                         "measured_share": [round(float(v), 4) for v in share],
                         "max_error": float(np.max(np.abs(share - target) / target)),
                         "step_s": float(np.median(rec["step_s"][3:])),
                         "local_cv": float(np.max(np.std(rec["local"][3:], axis=0) / local)),
                         "overruns": sum(e["overruns"] for e in rec["emu"] if e)})
    return rows


CHECK_COLUMNS = [("level", "level", "%s"), ("mode", "mode", "%s"),
                 ("max_error", "max share error", "%.3f"), ("local_cv", "local time cv", "%.3f"),
                 ("step_s", "step s", "%.4f"), ("overruns", "overruns", "%d")]


COLUMNS = [("level", "level", "%s"), ("plain_step_s", "plain s", "%.4f"),
           ("omnihvd_step_s", "omnihvd s", "%.4f"), ("reference_step_s", "ref s", "%.4f"),
           ("ideal_step_s", "ideal s", "%.4f"), ("efficiency", "eff", "%.3f"),
           ("speedup", "speedup", "%.2f"), ("theoretical_speedup", "theory", "%.2f"),
           ("omnihvd_vs_reference", "vs ref", "%.2f"),
           ("adjustments_to_converge", "adj", "%d"), ("steps_to_converge", "conv steps", "%d"),
           ("seconds_to_converge", "conv s", "%.1f"),
           ("reference_seconds_to_converge", "ref conv s", "%.1f"),
           ("overhead_per_step_s", "overhead s", "%.5f"), ("overrun_pct", "overrun %", "%.0f")]
TTA_COLUMNS = [("variant", "variant", "%s"), ("seed", "seed", "%d"), ("level", "level", "%s"),
               ("seconds_to_target", "s to target", "%.1f"), ("steps_to_target", "steps", "%d"),
               ("final_accuracy", "final acc", "%.4f"), ("train_seconds", "train s", "%.1f")]


def check_targets(rows):
    """The issue's targets, each with the measured value and whether it is met."""
    out = []

    def add(target, level, value, threshold, met):
        if value is not None:
            out.append({"target": target, "level": level, "value": value,
                        "threshold": threshold, "met": bool(met)})

    for row in rows:
        if "omnihvd_vs_reference" not in row:   # --check-emulation rows
            continue
        level = row["level"]
        label = level.split(":")[-1]
        if label in ("HL2", "HL4", "HL8"):
            add("efficiency >= 0.95", level, row["efficiency"], 0.95,
                row["efficiency"] is not None and row["efficiency"] >= 0.95)
            add("speed-up >= 95% of theory", level, row["speedup_fraction"], 0.95,
                row["speedup_fraction"] is not None and row["speedup_fraction"] >= 0.95)
        if label == "HL1" and row["plain_step_s"] and row["omnihvd_step_s"]:
            slower = row["omnihvd_step_s"] / row["plain_step_s"] - 1
            add("HL1 at most 2% slower than plain", level, slower, 0.02, slower <= 0.02)
        if row.get("segment", 0) > 0 and row["reconverge_periods"] is not None:
            add("re-converges within 2 periods", level, row["reconverge_periods"], 2,
                row["reconverge_periods"] <= 2)
        if row["omnihvd_vs_reference"] is not None:
            add("default as fast as reference", level, row["omnihvd_vs_reference"], 1.0,
                row["omnihvd_vs_reference"] >= 1.0)
    return out


TARGET_COLUMNS = [("target", "target", "%s"), ("level", "level", "%s"),
                  ("value", "measured", "%.3f"), ("threshold", "needed", "%g"),
                  ("met", "met", "%s")]


def code_version():
    """The git commit of the code measured (``+dirty`` with uncommitted changes), if known;
    ``OMNIHVD_CODE_VERSION`` where set (a copy made with ``git archive`` has no .git)."""
    import subprocess

    if os.environ.get("OMNIHVD_CODE_VERSION"):
        return os.environ["OMNIHVD_CODE_VERSION"]
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty=+dirty"], cwd=HERE,
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def save(args, rows, tta, started, complete, sample_cost=None):
    """Write results/<name>.json and, when complete, results/<name>.md (the tables)."""
    path = os.path.join(args.out, args.name + ".json")
    targets = check_targets(rows)
    doc = {"name": args.name, "complete": complete,
           "command": "mpirun -np %d %s %s" % (hvd.size(), os.path.relpath(__file__),
                                              " ".join(sys.argv[1:])),
           "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
           "code": code_version(),
           "wall_s": time.time() - started,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "torch": torch.__version__, "load_average": os.getloadavg()},
           "config": {k: v for k, v in vars(args).items() if k not in ("out",)},
           "sample_cost_s": sample_cost,
           "runs": rows, "time_to_accuracy": tta, "targets": targets}
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(path + ".tmp", path)
    if complete:
        with open(os.path.join(args.out, args.name + ".md"), "w") as f:
            f.write("Command: `%s` (code %s, %s, %.0f s, load average at the end %s, emulated "
                    "sample cost %s ms)\n\n" % (doc["command"], doc["code"], doc["started"], doc["wall_s"],
                                          "/".join("%.1f" % v for v in os.getloadavg()),
                                          "%.2f" % (sample_cost * 1e3) if sample_cost else "-"))
            for table in ((rows, COLUMNS), (tta, TTA_COLUMNS), (targets, TARGET_COLUMNS)):
                if table[0]:
                    f.write("```\n%s\n```\n\n" % telemetry.format_table(*table))
    return path


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    bench = Bench(args)
    started = time.time()
    plan = [(level, emulate.parse_schedule(level, bench.size)) for level in args.levels]
    if args.dynamic and not args.check_emulation:
        plan.append(("dynamic", emulate.parse_schedule(args.dynamic, bench.size)))
    if bench.sample_cost is None:
        speeds = [v for _, s in plan for seg in s.segments for v in seg.speeds]
        if args.tta:
            speeds += emulate.parse_schedule(args.tta_level, bench.size).speeds_at(0)
        bench.calibrate(max(speeds or [1.0]))
    if bench.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print("omnihvd benchmark: %d ranks, B=%d, model=%s, emulation %s (sample %.2g s, step "
              "%.2g s), %d steps/epoch" % (bench.size, bench.B, args.model, bench.mode,
                                           bench.sample_cost, bench.step_cost,
                                           bench.steps_per_epoch), flush=True)
    rows, tta = [], []
    if args.check_emulation:
        rows = check_emulation(bench)
        if bench.rank == 0:
            path = save(args, rows, tta, started, True, bench.sample_cost)
            print(telemetry.format_table(rows, CHECK_COLUMNS))
            for row in rows:
                print("%-4s %-6s target %s measured %s" % (row["level"], row["mode"],
                                                           row["target_share"], row["measured_share"]))
            print("results: %s" % os.path.relpath(path))
        return 0
    for tag, schedule in plan:
        rows += run_level(bench, tag, schedule, tag)
        if bench.rank == 0:
            save(args, rows, tta, started, False, bench.sample_cost)
    if args.cpu_plan:
        cpus, threads = emulate.parse_cpu_plan(args.cpu_plan, bench.size)[bench.rank], 1
        previous = emulate.pin_cpus(cpus, threads)
        flat = emulate.parse_schedule(",".join(["1"] * bench.size))
        rows += run_level(bench, "cpu", flat, "cpu " + args.cpu_plan, cpu_plan=args.cpu_plan)
        os.sched_setaffinity(0, previous)
    if args.tta:
        tta = time_to_accuracy(bench)
    if bench.rank == 0:
        path = save(args, rows, tta, started, True, bench.sample_cost)
        print()
        print(telemetry.format_table(rows, COLUMNS))
        if tta:
            print()
            print(telemetry.format_table(tta, TTA_COLUMNS))
        targets = check_targets(rows)
        if targets:
            print()
            print(telemetry.format_table(targets, TARGET_COLUMNS))
            missed = sum(not t["met"] for t in targets)
            if missed:
                print("\n%d target(s) not met. Emulated speeds hold only while each step's "
                      "real compute fits its emulated time: \"overrun %%\" is the share of "
                      "steps where it did not, and other work on the machine (load average "
                      "%.1f now) adds to the step times; rerun on a quiet machine before "
                      "reading a miss as omnihvd's" % (missed, os.getloadavg()[0]))
        print("\nresults: %s (tables: %s.md)" % (os.path.relpath(path), os.path.relpath(path)[:-5]))
        plots = sorted({p for row in rows + tta for p in row.get("plots", [])})
        print("plots:\n" + "\n".join("  " + os.path.relpath(os.path.join(HERE, p)) for p in plots))
        print("wall time: %.0f s" % (time.time() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main())
