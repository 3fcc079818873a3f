"""Where a step's time goes, rank by rank: a summary of the example's step anatomy.

Run the Horovod example with ``OMNIHVD_EXAMPLE_ANATOMY=FOLDER`` in the ranks'
environment (``benchmarks/run_realhet.sh ... --env OMNIHVD_EXAMPLE_ANATOMY=FOLDER``),
then::

    python benchmarks/step_anatomy.py FOLDER [--epoch 1] [--skip 10] [--out OUT]

For each run found (mode, split, job) it prints per rank the medians over the epoch's
steps (after the first ``--skip``) of: the samples, omnihvd's local time (what the
controller balances), the loop body before ``opt.step()``, the time inside
``opt.step()`` (waiting, the allreduce, the update), the period between step starts,
and the period minus the local time (what lies outside the rank's local time).
``--out OUT`` also writes OUT.json and OUT.md.

The rank that arrives last in a step waits for no one, so its time inside
``opt.step()`` is the step's *tail*: the allreduce and update that follow the last
arrival. The least of the ranks' medians of it is shown as the run's tail.

Per rank it also gives how often the rank arrived last (its local time, or in plain
mode its body before ``opt.step()``, the largest of the step), and per run the mean
over steps of that slowest arrival beside the largest of the ranks' means: the
difference is what the ranks' step-to-step noise costs a split of equal means
(:mod:`omnihvd.arrivals`).
"""
import argparse
import glob
import json
import os
import re
import statistics
from collections import defaultdict

NAME = re.compile(r"^anatomy-(?P<run>.+)-e(?P<epoch>\d+)-r(?P<rank>\d+)\.json$")
FIELDS = ("samples", "local_s", "before_step_s", "in_step_s", "period_s")


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def rank_summary(steps, skip=0):
    """Medians of one rank's steps (``None`` where a field was never recorded).

    >>> steps = [{"samples": 8, "local_s": 0.1, "before_step_s": 0.09, "in_step_s": 0.05,
    ...           "period_s": 0.16}] * 3
    >>> s = rank_summary(steps)
    >>> s["samples"], round(s["outside_local_s"], 3)
    (8, 0.06)
    """
    kept = steps[skip:]
    if not kept:
        raise ValueError("no steps left after skipping %d of %d" % (skip, len(steps)))
    out = {f: _median([s.get(f) for s in kept]) for f in FIELDS}
    out["steps"] = len(kept)
    local, period = out["local_s"], out["period_s"]
    out["outside_local_s"] = None if local is None or period is None else period - local
    return out


def summarize(folder, epoch=None, skip=10):
    """``{run: {"epoch": E, "ranks": [rank summaries], "tail_s": ...}}`` for each run in
    ``folder`` (its last epoch unless ``epoch`` is given)."""
    files = defaultdict(dict)
    for path in glob.glob(os.path.join(folder, "anatomy-*.json")):
        m = NAME.match(os.path.basename(path))
        if m:
            files[m["run"]].setdefault(int(m["epoch"]), {})[int(m["rank"])] = path
    runs = {}
    for run, epochs in sorted(files.items()):
        e = max(epochs) if epoch is None else epoch
        if e not in epochs:
            continue
        ranks = epochs[e]
        if sorted(ranks) != list(range(len(ranks))):
            raise ValueError("%s epoch %d: ranks %s, not 0..n-1" % (run, e, sorted(ranks)))
        steps = []
        for r in range(len(ranks)):
            with open(ranks[r]) as f:
                steps.append(json.load(f))
        summaries = [rank_summary(s, skip) for s in steps]
        arrivals = last_arrivals(steps, skip)
        for s, share in zip(summaries, arrivals.pop("last_share")):
            s["last_share"] = share
        runs[run] = dict({"epoch": e, "ranks": summaries,
                          "tail_s": min(s["in_step_s"] for s in summaries)}, **arrivals)
    return runs


def last_arrivals(ranks_steps, skip=0):
    """Who arrived last, step by step: each rank's share of the steps in which its
    local time (``before_step_s`` when there is none) was the largest, the mean over
    steps of that largest time, and the largest of the ranks' mean times.

    >>> a = [{"local_s": 0.1}, {"local_s": 0.1}, {"local_s": 0.1}, {"local_s": 0.1}]
    >>> b = [{"local_s": 0.15}, {"local_s": 0.05}, {"local_s": 0.15}, {"local_s": 0.05}]
    >>> out = last_arrivals([a, b])
    >>> out["last_share"], round(out["mean_slowest_s"], 3), round(out["slowest_mean_s"], 3)
    ([0.5, 0.5], 0.125, 0.1)
    """
    steps = min(len(s) for s in ranks_steps)
    table = [[s[i].get("local_s") if s[i].get("local_s") is not None
              else s[i].get("before_step_s") for s in ranks_steps] for i in range(skip, steps)]
    table = [row for row in table if all(v is not None for v in row)]
    if not table:
        return {"last_share": [None] * len(ranks_steps), "mean_slowest_s": None,
                "slowest_mean_s": None}
    last = [row.index(max(row)) for row in table]
    return {"last_share": [last.count(r) / len(table) for r in range(len(ranks_steps))],
            "mean_slowest_s": statistics.fmean(max(row) for row in table),
            "slowest_mean_s": max(statistics.fmean(col) for col in zip(*table))}


def _ms(value):
    return "-" if value is None else "%.1f" % (1000 * value)


def markdown(runs):
    lines = ["| run | rank | samples | local ms | before step() ms | in step() ms | period ms "
             "| period - local ms | arrived last |", "|---|---|---|---|---|---|---|---|---|"]
    for run, data in runs.items():
        for r, s in enumerate(data["ranks"]):
            share = s.get("last_share")
            lines.append("| %s | %d | %g | %s | %s | %s | %s | %s | %s |" % (
                run if r == 0 else "", r, s["samples"], _ms(s["local_s"]),
                _ms(s["before_step_s"]), _ms(s["in_step_s"]), _ms(s["period_s"]),
                _ms(s["outside_local_s"]), "-" if share is None else "%.0f%%" % (100 * share)))
        lines.append("| | tail | | | | %s | | | |" % _ms(data["tail_s"]))
        if data.get("mean_slowest_s") is not None:
            lines.append("| | slowest arrival: mean over steps %s ms, largest rank mean %s ms "
                         "| | | | | | | |" % (_ms(data["mean_slowest_s"]),
                                              _ms(data["slowest_mean_s"])))
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--epoch", type=int, default=None, help="default: each run's last")
    p.add_argument("--skip", type=int, default=10, help="leave out the epoch's first steps")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    runs = summarize(args.folder, args.epoch, args.skip)
    if not runs:
        raise SystemExit("no anatomy-*.json files in %s" % args.folder)
    emit(markdown(runs), {"folder": os.path.abspath(args.folder), "skip": args.skip,
                          "runs": runs}, args.out)
    return 0


def emit(text: str, document: dict, out=None):
    """Print the summary ``text``; with ``out``, also write OUT.md (the text) and
    OUT.json (``document``)."""
    print(text, end="")
    if out:
        with open(out + ".json", "w") as f:
            json.dump(document, f, indent=1)
        with open(out + ".md", "w") as f:
            f.write(text)


if __name__ == "__main__":
    raise SystemExit(main())
