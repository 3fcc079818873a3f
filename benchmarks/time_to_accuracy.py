"""Time to a target test accuracy under real CPU heterogeneity: omnihvd, plain Horovod
and the best fixed split, several seeds each.

The ranks of examples/train_fashion_mnist.py run under mpirun and are made unequal
from outside by benchmarks/realhet.py's launcher (core sets and CFS quotas, the
paper's levels as quotas; a level may change mid-run). Every launch trains the same
model with the same global batch and learning-rate schedule; only the split of the
global batch differs:

  plain    plain Horovod, equal batches (DistributedSampler)
  omnihvd  OmniLearnCallback with its default options, started from the equal split
  fixed    omnihvd's sampler and weighting with balancing off, at the best fixed split
           of the level: chosen before the measured launches by a short timed search
           over the splits realhet.candidate_splits derives from the known CPU shares
           (``fixed_candidates``, ``--lambdas``) and any ``--splits`` (``search_score``)

For each level, seed and mode one launch of ``--epochs`` epochs; rank 0 prints each
epoch's training time (evaluation excluded) and its test accuracy, and the time to
``--target`` is the training time until the accuracy first reaches it, linear between
evaluations (``time_to_target``). Seeds set the initial weights and the data order
(the example's ``--seed``); within a seed the modes run back to back, their order
rotated by one place per seed (realhet.run_order); the seeds go round the levels
(every search first). A level is ``NAME=SPEC`` in
realhet's syntax; its phases after the first begin every ``--epochs-per-phase``
epochs (``phase_schedule``)::

    flock -x /tmp/omnihvd-cpu.lock .venv/bin/python benchmarks/time_to_accuracy.py

Results: <out>.json (every launch, every epoch), <out>.md (the table) and --plot
(test accuracy against training time, one panel per level).
"""
import argparse
import json
import math
import os
import platform
import shlex
import signal
import statistics
import sys
import time
from typing import List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import realhet  # noqa: E402
from realhet import Phase  # noqa: E402

MODES = ("plain", "omnihvd", "fixed")
# HL4: the paper's four workers, 9, 9, 6 and 24 cores, as quotas of 9/32 ... 24/32 of
# a core; the three slow ranks share CPU 0, the fast one has CPU 1 (docker --cpus with
# --cpuset-cpus). The change: HL2 (12, 12, 8, 16 cores) becomes HL8 (6, 6, 4, 32).
LEVELS = ("HL4+cpuset=pin=0,0,0,1 quota=HL4",
          "HL2->HL8+cpuset=pin=0,0,0,1 quota=HL2 | pin=0,0,0,1 quota=HL8")
CHANCE = 0.1   # Fashion-MNIST's 10 classes: the accuracy of the untrained model


def time_to_target(seconds: Sequence[float], accuracies: Sequence[float], target: float,
                   start: float = CHANCE) -> Optional[float]:
    """Training seconds until the test accuracy first reaches ``target``.

    Accuracy is known at the end of each epoch (``seconds[i]`` long, ``accuracies[i]``
    after it) and, at time 0, taken as ``start`` (chance); in between it is taken as
    linear, so the first epoch that reaches the target contributes the share of its
    time that the last piece of the climb needs.

    Args:
        seconds: each epoch's training time, in order.
        accuracies: the test accuracy after each epoch (same length).
        target: the accuracy to reach.
        start: the accuracy at time 0.

    Returns:
        The seconds, or None when no epoch reaches ``target``.

    Raises:
        ValueError: the two sequences differ in length or a time is negative.

    >>> round(time_to_target([10, 10, 10], [0.7, 0.8, 0.9], 0.85), 9)
    25.0
    >>> time_to_target([10, 10], [0.7, 0.8], 0.85) is None
    True
    """
    if len(seconds) != len(accuracies):
        raise ValueError("time_to_target: %d epoch times but %d accuracies"
                         % (len(seconds), len(accuracies)))
    if any(s < 0 for s in seconds):
        raise ValueError("time_to_target: negative epoch time in %s" % (list(seconds),))
    if start >= target:
        return 0.0
    t, before = 0.0, start
    for s, acc in zip(seconds, accuracies):
        if acc >= target:
            return t + s * (target - before) / (acc - before)
        t, before = t + s, acc
    return None


def curve(seconds: Sequence[float], accuracies: Sequence[float]):
    """``(times, accuracies)`` from the start (0 s, chance) through each epoch's end.

    >>> curve([2.0, 3.0], [0.5, 0.6])
    ([0.0, 2.0, 5.0], [0.1, 0.5, 0.6])
    """
    times = [0.0]
    for s in seconds:
        times.append(times[-1] + s)
    return times, [CHANCE] + list(accuracies)


def phase_schedule(phases: List[Phase], epochs_per_phase: int) -> List[Phase]:
    """The phases as realhet.run_once applies them (phase i after epoch i - 1): each
    given phase but the last repeated for ``epochs_per_phase`` epochs, the last to the
    end of the launch.

    >>> phase_schedule(["A", "B"], 2), phase_schedule(["A"], 3), phase_schedule("ABC", 1)
    (['A', 'A', 'B'], ['A'], ['A', 'B', 'C'])
    """
    if epochs_per_phase < 1:
        raise ValueError("epochs_per_phase must be >= 1, got %r" % (epochs_per_phase,))
    return [p for p in phases[:-1] for _ in range(epochs_per_phase)] + [phases[-1]]


def phase_weights(num_phases: int, epochs: int, epochs_per_phase: int) -> List[float]:
    """The share of a launch's epochs spent in each phase (``phase_schedule``).

    >>> phase_weights(2, 4, 2), phase_weights(1, 4, 2)
    ([0.5, 0.5], [1.0])
    """
    counts = [epochs_per_phase] * (num_phases - 1)
    counts.append(epochs - sum(counts))
    if counts[-1] < 1:
        raise ValueError("%d epochs leave none for the last of %d phases of %d epochs each"
                         % (epochs, num_phases, epochs_per_phase))
    return [c / epochs for c in counts]


def search_score(epoch_seconds: Sequence[float], weights: Sequence[float]) -> float:
    """A fixed split's expected seconds per search epoch over a measured launch.

    A search launch runs one warm-up epoch (left out) and then one epoch in each phase;
    the phases' times are weighted by their share of a measured launch (``phase_weights``).

    >>> search_score([9.0, 2.0, 4.0], [0.5, 0.5])
    3.0
    """
    if len(epoch_seconds) != len(weights) + 1:
        raise ValueError("a search launch has a warm-up epoch and one per phase: %d epochs "
                         "for %d phases" % (len(epoch_seconds), len(weights)))
    return sum(w * s for w, s in zip(weights, epoch_seconds[1:]))


def spread(values: Sequence[Optional[float]]) -> dict:
    """Median, min and max of the values, None (not reached) counted as infinitely
    late; ``reached``: how many are not None.

    >>> spread([3.0, None, 1.0])
    {'median': 3.0, 'min': 1.0, 'max': None, 'reached': 2, 'n': 3}
    """
    late = [math.inf if v is None else v for v in values]

    def finite(v):
        return None if math.isinf(v) else v

    if not late:
        return {"median": None, "min": None, "max": None, "reached": 0, "n": 0}
    return {"median": finite(statistics.median(late)), "min": finite(min(late)),
            "max": finite(max(late)), "reached": len(values) - values.count(None),
            "n": len(values)}


# ------------------------------------------------------------------ launches

def launch(hargs, phases, mode, split, seed, tag, epochs, steps) -> dict:
    """One realhet.run_once with this seed, epochs and steps."""
    hargs.epochs, hargs.steps = epochs, steps
    hargs.script_args = ["--seed", str(seed)] + hargs.base_script_args
    rec = realhet.run_once(hargs, phases, mode, split, tag)
    rec["seed"] = seed
    return rec


def fixed_candidates(shares: Sequence[Sequence[float]], weights: Sequence[float], B: int,
                     lambdas: Sequence[float]) -> List[List[int]]:
    """The fixed splits a user who knew each phase's CPU shares (cores per rank) and how
    long it lasts would try: for each lambda, equal + lambda * (proportional to the
    shares averaged over the launch - equal) (lambda > 1 leans further to the fast
    ranks: a slow rank's quota also pays for Horovod's background thread); with
    several phases, each phase's proportional split too. Each once, the equal split
    (plain Horovod's) left out.

    >>> fixed_candidates([[0.5, 0.5, 1.0], [1.0, 0.5, 0.5]], [0.5, 0.5], 192, [1.0])
    [[72, 48, 72], [48, 48, 96], [96, 48, 48]]
    """
    mean = [sum(w * s[r] for w, s in zip(weights, shares)) for r in range(len(shares[0]))]
    return realhet.distinct_splits(
        [realhet.scaled_split(mean, B, lam) for lam in lambdas] +
        [realhet.scaled_split(s, B, 1.0) for s in shares if len(shares) > 1])


def search_fixed(hargs, args, name, phases, B) -> dict:
    """Time each candidate split once in a short launch; the lowest ``search_score``
    wins (a single candidate is taken as it is)."""
    weights = phase_weights(len(phases), args.epochs, args.epochs_per_phase)
    candidates = fixed_candidates([realhet.shares(p, hargs.available) for p in phases],
                                  weights, B, args.lambdas)
    candidates += [s for s in realhet.given_splits(args.splits, phases[0].num_ranks, B)
                   if s not in candidates]
    tried = []
    if len(candidates) == 1:   # nothing to choose between
        return {"best": candidates[0], "tried": [], "steps": 0}
    for k, split in enumerate(candidates):
        rec = launch(hargs, [phases[0]] + phases, "fixed", split, args.seeds[0],
                     "s%d" % k, len(phases) + 1, args.search_steps)
        seconds = [e["seconds"] for e in rec["epochs"]]
        score = None if rec.get("error") else search_score(seconds, weights)
        tried.append({"split": split, "epoch_s": seconds, "score_s": score,
                      "error": rec.get("error")})
        print("  %-18s search %-16s %s" % (name, realhet.turns_text(split),
                                          "%.3f s/epoch" % score if score is not None
                                          else "FAILED: " + realhet.failure(rec)), flush=True)
    ok = [t for t in tried if t["score_s"] is not None]
    if not ok:
        raise SystemExit("level %s: every fixed split of the search failed" % name)
    return {"best": min(ok, key=lambda t: t["score_s"])["split"], "tried": tried,
            "steps": args.search_steps}


def summarize(runs: List[dict], target: float) -> dict:
    """Per mode: time to target and final accuracy over seeds."""
    out = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode and not r.get("error")]
        if not mine:
            continue
        out[mode] = {"time_to_target_s": spread([r["time_to_target_s"] for r in mine]),
                     "final_accuracy": spread([r["epochs"][-1]["accuracy"] for r in mine]),
                     "train_s": spread([sum(e["seconds"] for e in r["epochs"]) for r in mine]),
                     "failed": sum(1 for r in runs if r["mode"] == mode and r.get("error"))}
    if "plain" in out and "omnihvd" in out:
        p, o = (out[m]["time_to_target_s"]["median"] for m in ("plain", "omnihvd"))
        out["omnihvd_below_plain"] = o is not None and (p is None or o < p)
    return out


def prepare_level(hargs, args, name, spec) -> dict:
    """A level's record: its phases' shares and its fixed split (searched or given)."""
    phases = realhet.parse_spec(spec, hargs.available)
    n = phases[0].num_ranks
    B = args.batch_per_rank * n
    print("level %s (%s): %d ranks, global batch %d" % (name, spec, n, B), flush=True)
    if args.fixed_split is not None:
        fixed = {"best": args.fixed_split, "tried": [], "given": True}
    else:
        fixed = search_fixed(hargs, args, name, phases, B)
    return {"level": name, "spec": spec, "ranks": n, "global_batch": B,
            "shares": [realhet.shares(p, hargs.available) for p in phases],
            "epochs_per_phase": args.epochs_per_phase, "fixed": fixed, "runs": []}


def run_seed(hargs, args, level, i, save) -> None:
    """One launch per mode of seed ``args.seeds[i]`` at ``level``, the order rotated
    by ``i``."""
    seed = args.seeds[i]
    schedule = phase_schedule(realhet.parse_spec(level["spec"], hargs.available),
                              args.epochs_per_phase)
    modes = [(m, level["fixed"]["best"] if m == "fixed" else None) for m in args.modes]
    for position, k in enumerate(realhet.run_order(len(modes), i)):
        mode, split = modes[k]
        rec = launch(hargs, schedule, mode, split, seed, "%d-%d" % (seed, k),
                     args.epochs, args.steps)
        rec["position"] = position
        if not rec.get("error"):
            seconds = [e["seconds"] for e in rec["epochs"]]
            accs = [e["accuracy"] for e in rec["epochs"]]
            rec["time_to_target_s"] = time_to_target(seconds, accs, args.target)
        level["runs"].append(rec)
        print("  %-18s seed %d %-8s %s" % (
            level["level"], seed, mode, realhet.failure(rec) if rec.get("error") else
            "to %.2f: %s, accuracy %s, %.1f s trained, sizes %s" % (
                args.target, _s(rec["time_to_target_s"]),
                " ".join("%.3f" % e["accuracy"] for e in rec["epochs"]),
                sum(e["seconds"] for e in rec["epochs"]), rec["final_sizes"])), flush=True)
        level["summary"] = summarize(level["runs"], args.target)
        save()


# ------------------------------------------------------------------ output

def _s(v, f="%.1f s"):
    return "not reached" if v is None else f % v


def _range(sp, f="%.1f"):
    return "%s (%s-%s)" % tuple(("-" if v is None else f % v)
                               for v in (sp["median"], sp["min"], sp["max"]))


def markdown(doc) -> str:
    out = ["Command: `%s` (code %s at %s)" % (doc["command"], doc["code_tree"],
                                             doc["code_version"] or "?"), "",
           "Machine: %s; %d CPUs; finished %s UTC." % (doc["machine"]["platform"],
                                                       doc["machine"]["cpus"], doc["finished"]),
           "",
           "Time to %.0f%% test accuracy (the first %d Fashion-MNIST test images, after each "
           "epoch of %d steps; training seconds, evaluation excluded, linear between "
           "evaluations), median (min-max) over seeds %s; final accuracy after %d epochs, "
           "median (min-max). Same model, global batch and learning rate in every mode."
           % (100 * doc["target"], doc["test_images"], doc["steps"],
              ",".join(map(str, doc["seeds"])), doc["epochs"]), "",
           "| level | spec | mode | split | time to target s | reached | final accuracy "
           "| training s | vs plain (median) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for lv in doc["levels"]:
        summ = lv.get("summary", {})
        plain = summ.get("plain", {}).get("time_to_target_s", {}).get("median")
        for i, mode in enumerate(m for m in MODES if m in summ):
            s = summ[mode]
            med = s["time_to_target_s"]["median"]
            split = {"plain": "equal", "omnihvd": "balanced",
                     "fixed": realhet.turns_text(lv["fixed"]["best"])}[mode]
            out.append("| %s | %s | %s | %s | %s | %d/%d | %s | %s | %s |" % (
                lv["level"] if i == 0 else "", "`%s`" % lv["spec"].replace("|", "\\|")
                if i == 0 else "", mode, split, _range(s["time_to_target_s"]),
                s["time_to_target_s"]["reached"], s["time_to_target_s"]["n"],
                _range(s["final_accuracy"], "%.3f"), _range(s["train_s"]),
                "%.2fx" % (plain / med) if plain and med else "-"))
    out.append("")
    for lv in doc["levels"]:
        if "omnihvd_below_plain" in lv.get("summary", {}):
            out.append("- %s: omnihvd's median time to target %s plain Horovod's." % (
                lv["level"], "is below" if lv["summary"]["omnihvd_below_plain"]
                else "is NOT below"))
        tried = lv["fixed"].get("tried")
        if tried:
            out.append("- %s: fixed splits searched (%d steps an epoch, seconds per epoch "
                       "weighted by phase): %s" % (
                           lv["level"], lv["fixed"]["steps"], ", ".join(
                               "%s %s" % (realhet.turns_text(t["split"]), "failed"
                                          if t["score_s"] is None else "%.2f" % t["score_s"])
                               for t in tried)))
    return "\n".join(out) + "\n"


COLORS = {"plain": "tab:red", "omnihvd": "tab:blue", "fixed": "tab:green"}


def plot(doc, path: str) -> None:
    """Test accuracy against training time, every launch, one panel per level."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = doc["levels"]
    fig, axes = plt.subplots(1, len(levels), figsize=(6 * len(levels), 4.2), squeeze=False)
    for ax, lv in zip(axes[0], levels):
        for mode in MODES:
            summ = lv.get("summary", {}).get(mode)
            label = mode if summ is None else "%s: %s" % (
                mode, _s(summ["time_to_target_s"]["median"], "median %.0f s"))
            for r in (r for r in lv["runs"] if r["mode"] == mode and not r.get("error")):
                t, a = curve([e["seconds"] for e in r["epochs"]],
                             [e["accuracy"] for e in r["epochs"]])
                ax.plot(t, a, "-o", color=COLORS[mode], alpha=0.7, ms=3, lw=1.2, label=label)
                label = None
                changes = [lv["epochs_per_phase"] * k for k in range(1, len(lv["shares"]))]
                ax.plot([t[i] for i in changes if i < len(t)],
                        [a[i] for i in changes if i < len(a)], "x", color=COLORS[mode], ms=8)
        ax.axhline(doc["target"], color="grey", ls="--", lw=0.8)
        ax.set_ylim(max(0.0, doc["target"] - 0.2), min(1.0, doc["target"] + 0.08))
        ax.set_title("%s (%d ranks)%s" % (lv["level"], lv["ranks"], "; x: the change"
                                           if len(lv["shares"]) > 1 else ""))
        ax.set_xlabel("training time, s (evaluation excluded)")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize=8)
    fig.suptitle("Fashion-MNIST to %.0f%%: one line per seed" % (100 * doc["target"]))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(doc, out: str, plot_path: Optional[str]) -> None:
    """OUT.json, OUT.md and the plot."""
    realhet.write(doc, out, markdown)
    if plot_path:
        plot(doc, plot_path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", nargs="+", default=list(LEVELS),
                   help="NAME=SPEC (realhet's syntax) or a realhet scenario name")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--target", type=float, default=0.85, help="test accuracy to reach")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=100,
                   help="steps per epoch (the first steps * global batch training images)")
    p.add_argument("--epochs-per-phase", type=int, default=1,
                   help="epochs of each phase of a level before the next (the last to the end)")
    p.add_argument("--batch-per-rank", type=int, default=64, help="global batch = this * ranks")
    p.add_argument("--lambdas", default="1.5",
                   help="fixed splits searched: equal + lambda * (proportional to shares - "
                        "equal), see fixed_candidates (1.5: at HL4 realhet's searches over "
                        "many launches found 39,39,15,163 best, about lambda 1.5)")
    p.add_argument("--splits", default="", help="more fixed splits to search, joined by /")
    p.add_argument("--search-steps", type=int, default=30,
                   help="steps per epoch of a search launch")
    p.add_argument("--fixed-split", default=None,
                   help="skip the search: this split (e.g. 39,39,15,163) for every level")
    p.add_argument("--script-args", default="", metavar="'OPTIONS'",
                   help="more options for the example, e.g. --script-args='--lr 0.02'")
    p.add_argument("--code", default=ROOT, help="omnihvd tree to test (and its example)")
    p.add_argument("--period-us", type=int, default=10000, help="CFS quota period")
    p.add_argument("--run-timeout", type=int, default=600, help="seconds per launch")
    p.add_argument("--out", default=os.path.join(HERE, "results", "time-to-accuracy"))
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "img", "time-to-accuracy.png"),
                   help="the PNG ('' for none)")
    p.add_argument("--render", action="store_true",
                   help="run nothing: rewrite OUT.md and the plot from OUT.json")
    args = p.parse_args(argv)
    args.seeds = [int(v) for v in args.seeds.split(",") if v]
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.seeds or set(args.modes) - set(MODES) or not args.modes:
        p.error("--seeds takes integers, --modes some of %s" % ",".join(MODES))
    args.lambdas = [float(v) for v in args.lambdas.split(",") if v]
    args.code = os.path.abspath(args.code)
    args.command = " ".join(["python", os.path.relpath(os.path.abspath(__file__), ROOT)] +
                            [shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)])
    args.levels = [realhet.scenario_arg(v) for v in args.levels]
    hargs = realhet.parse_args(
        ["--scenarios"] + [spec or name for name, spec in args.levels] +
        ["--code", args.code, "--script", os.path.join(args.code, "examples",
                                                        "train_fashion_mnist.py"),
         "--batch-per-rank", str(args.batch_per_rank), "--period-us", str(args.period_us),
         "--run-timeout", str(args.run_timeout), "--lambdas", "", "--epochs", str(args.epochs),
         "--place-when-ready"])
    hargs.base_script_args = shlex.split(args.script_args)
    fixed, args.fixed_split = args.fixed_split, None
    for name, spec in args.levels:
        phases = realhet.parse_spec(spec, hargs.available)
        try:
            phase_weights(len(phases), args.epochs, args.epochs_per_phase)
        except ValueError as exc:
            p.error("level %s: %s" % (name, exc))
        n = phases[0].num_ranks
        if fixed is not None:
            (args.fixed_split,) = realhet.given_splits(fixed, n, args.batch_per_rank * n)
    return args, hargs


def main(argv=None):
    args, hargs = parse_args(argv)
    if args.render:
        with open(args.out + ".json") as f:
            write(json.load(f), args.out, args.plot)
        return 0
    for sig in realhet.STOP_SIGNALS:
        signal.signal(sig, realhet._terminate)
    stale = realhet.cpulimits.remove_stale_groups(realhet.GROUP_PREFIX,
                                                  realhet.find_cpu_controller())
    if stale:
        print("removed stale cgroups of killed runs: %s" % ", ".join(stale))
    started = time.time()
    doc = {"command": args.command, "code_tree": args.code,
           "code_version": realhet.code_version(args.code), "target": args.target,
           "seeds": args.seeds, "epochs": args.epochs, "steps": args.steps,
           "test_images": 2000, "script_args": hargs.base_script_args, "levels": []}

    def save():
        doc.update({"finished": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                    "wall_s": time.time() - started,
                    "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                "load_average": os.getloadavg()}})
        write(doc, args.out, args.plot)

    # every search first, then seed by seed through the levels: a run cut short has
    # every level at its first seeds
    doc["levels"] = [prepare_level(hargs, args, name, spec) for name, spec in args.levels]
    for i in range(len(args.seeds)):
        for level in doc["levels"]:
            run_seed(hargs, args, level, i, save)
    for level in doc["levels"]:
        summ = level.get("summary", {})
        print("%s: %s" % (level["level"], "; ".join(
            "%s %s" % (m, _range(summ[m]["time_to_target_s"])) for m in MODES if m in summ)),
            flush=True)
    save()
    print("results: %s.json, %s.md%s" % (args.out, args.out,
                                         ", " + args.plot if args.plot else ""))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:   # the runs' processes and cgroups are gone already
        sys.exit("interrupted (%s); every run's processes and cgroups were removed"
                 % (exc or "Ctrl-C"))
