"""Release lags and arrivals, step by step: when each rank resumes after the allreduce.

``benchmarks/train_turns.py`` records, with ``OMNIHVD_STEP_TIMESTAMPS=FOLDER`` in the
ranks' environment (``benchmarks/run_realhet.sh ... --modes alternate --env
OMNIHVD_STEP_TIMESTAMPS=FOLDER``), each step's moments on ``time.perf_counter``
(the machine's monotonic clock, one for all ranks of a machine): the loop body's
start, the entry of ``opt.step()`` (the arrival), the return of the gradients'
synchronize (the release) and the end of ``opt.step()``, with omnihvd's local time.
Then::

    python benchmarks/release_lags.py FOLDER [--skip 10] [--out OUT]

gives, for each launch and epoch (its turn named), per rank the means over steps
of: the samples, omnihvd's local time, the *release lag* (its release minus the
first rank's in the same step, :mod:`omnihvd.lags`) and the *arrival* (its next
entry of ``opt.step()`` minus that first release); and per epoch the mean period
(first release to first release). Equal arrivals, not equal local times, make the
shortest step. One machine only: the ranks' clocks are compared.

And the *handoff*: from a step's last entry of ``opt.step()`` to its first release,
the part of the allreduce no rank's local time or arrival holds. Per epoch its mean,
the mean *gap* by which the last rank arrived after the one before it, and per rank
how often it arrived last and the mean handoff of those steps (``-``: never).
"""
import argparse
import glob
import json
import os
import re
import time
import warnings
from collections import defaultdict

import numpy as np

from step_anatomy import emit

ENV = "OMNIHVD_STEP_TIMESTAMPS"
NAME = re.compile(r"^steps-(?P<job>[^-]+)-e(?P<epoch>\d+)-r(?P<rank>\d+)\.json$")


class StepTimestamps:
    """Per-step moments of one rank (off unless ``OMNIHVD_STEP_TIMESTAMPS`` is set).

    It notes the release by wrapping ``opt.synchronize`` (Horovod's ``step()`` calls
    it through the instance), which costs one ``perf_counter`` call per step.
    """

    def __init__(self, optimizer, rank: int):
        self.folder = os.environ.get(ENV) or None
        self._rank, self._steps = rank, []
        if self.folder:
            synchronize = optimizer.synchronize

            def noted_synchronize():
                out = synchronize()
                if self._steps:
                    self._steps[-1]["release"] = time.perf_counter()
                return out

            optimizer.synchronize = noted_synchronize
        job = os.environ.get("PMIX_NAMESPACE") or str(os.getppid())
        self._job = re.sub(r"[^0-9A-Za-z]", "", job)

    def begin(self, samples: int):
        if self.folder:
            self._steps.append({"samples": int(samples), "begin": time.perf_counter()})

    def before_step(self):
        if self.folder:
            self._steps[-1]["arrival"] = time.perf_counter()

    def after_step(self, cb):
        if self.folder:
            self._steps[-1].update(end=time.perf_counter(), local=cb.last_step_time)

    def end_epoch(self, epoch: int, turn: str):
        if not self.folder:
            return
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, "steps-%s-e%d-r%d.json" % (self._job, epoch, self._rank))
        with open(path, "w") as f:
            json.dump({"turn": turn, "steps": self._steps}, f)
        self._steps = []


def _table(steps, field):
    return np.array([[s.get(field) if s.get(field) is not None else np.nan for s in row]
                     for row in steps], dtype=np.float64)


def summarize_epoch(ranks_steps, skip=10):
    """Means over one epoch's steps (after ``skip``) for each rank, and the period.

    >>> a = [{"samples": 8, "begin": 0.0, "arrival": 0.03, "release": 0.040, "local": 0.03},
    ...      {"samples": 8, "begin": 0.041, "arrival": 0.071, "release": 0.080, "local": 0.03}]
    >>> b = [{"samples": 4, "begin": 0.0, "arrival": 0.02, "release": 0.043, "local": 0.02},
    ...      {"samples": 4, "begin": 0.046, "arrival": 0.066, "release": 0.083, "local": 0.02}]
    >>> out = summarize_epoch([a, b], skip=0)
    >>> [round(v, 3) for v in out["lag_s"]], [round(v, 3) for v in out["arrival_s"]]
    ([0.0, 0.003], [0.031, 0.026])
    >>> round(out["period_s"], 3)
    0.04
    """
    n = min(len(s) for s in ranks_steps)
    steps = [[s[i] for s in ranks_steps] for i in range(n)]
    release, arrival = _table(steps, "release"), _table(steps, "arrival")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # steps or ranks without a value
        first = np.nanmin(release, axis=1)
        lag = (release - first[:, None])[skip:]
        arrive = (arrival[1:] - first[:-1, None])[skip:]
        period = np.diff(first)[skip:]
        handoff = handoff_summary(arrival[skip:], first[skip:])
        return {"samples": [int(v) for v in np.nanmedian(_table(steps, "samples"), axis=0)],
                "local_s": np.nanmean(_table(steps, "local")[skip:], axis=0).tolist(),
                "lag_s": np.nanmean(lag, axis=0).tolist(),
                "arrival_s": np.nanmean(arrive, axis=0).tolist(),
                "period_s": float(np.nanmean(period)), "steps": int(len(period)), **handoff}


def handoff_summary(arrival, first):
    """The handoff of each step whose every rank arrived (its first release ``first``
    minus its last arrival), summarised: ``handoff_s`` (mean), ``gap_s`` (mean time
    between the last two arrivals), ``last`` (steps each rank arrived last in) and
    ``handoff_when_last_s`` (per rank, the mean handoff of those steps; NaN: none).

    >>> out = handoff_summary(np.array([[1.00, 1.02], [2.03, 2.00], [3.00, 3.04]]),
    ...                np.array([1.03, 2.05, 3.05]))
    >>> out["last"], [round(v, 3) for v in out["handoff_when_last_s"]]
    ([1, 2], [0.02, 0.01])
    >>> round(out["handoff_s"], 4), round(out["gap_s"], 4)
    (0.0133, 0.03)
    """
    whole = np.isfinite(arrival).all(axis=1) & np.isfinite(first)
    a, f = arrival[whole], first[whole]
    n = arrival.shape[1]
    if not len(a):
        return {"handoff_s": float("nan"), "gap_s": float("nan"), "last": [0] * n,
                "handoff_when_last_s": [float("nan")] * n}
    last = np.argmax(a, axis=1)
    handoff = f - a.max(axis=1)
    ordered = np.sort(a, axis=1)
    when_last = [float(np.mean(handoff[last == r])) if np.any(last == r) else float("nan")
                 for r in range(n)]
    return {"handoff_s": float(np.mean(handoff)),
            "gap_s": float(np.mean(ordered[:, -1] - ordered[:, -2])) if n > 1 else 0.0,
            "last": [int(np.sum(last == r)) for r in range(n)],
            "handoff_when_last_s": when_last}


def summarize(folder, skip=10):
    """``[{job, epoch, turn, ...summarize_epoch}]`` for every epoch recorded in ``folder``."""
    files = defaultdict(dict)
    for path in glob.glob(os.path.join(folder, "steps-*.json")):
        m = NAME.match(os.path.basename(path))
        if m:
            files[(m["job"], int(m["epoch"]))][int(m["rank"])] = path
    out = []
    for (job, epoch), ranks in sorted(files.items()):
        if sorted(ranks) != list(range(len(ranks))):
            continue   # a launch cut short
        data = []
        for r in range(len(ranks)):
            with open(ranks[r]) as f:
                data.append(json.load(f))
        out.append(dict(job=job, epoch=epoch, turn=data[0]["turn"],
                        **summarize_epoch([d["steps"] for d in data], skip)))
    return out


def markdown(rows):
    ms = lambda values: " / ".join("%.1f" % (1000 * v) for v in values)  # noqa: E731
    lines = ["| launch | epoch | turn | samples | local ms | release lag ms | arrival ms "
             "| period ms | handoff ms | gap ms | last in (steps) | handoff when last ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| %s | %d | %s | %s | %s | %s | %s | %.1f | %.1f | %.1f | %s | %s |" % (
            r["job"][-6:], r["epoch"], r["turn"], "/".join(map(str, r["samples"])),
            ms(r["local_s"]), ms(r["lag_s"]), ms(r["arrival_s"]), 1000 * r["period_s"],
            1000 * r["handoff_s"], 1000 * r["gap_s"], "/".join(map(str, r["last"])),
            ms(r["handoff_when_last_s"]).replace("nan", "-")))
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--skip", type=int, default=10, help="leave out each epoch's first steps")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    rows = summarize(args.folder, args.skip)
    if not rows:
        raise SystemExit("no steps-*.json files in %s" % args.folder)
    emit(markdown(rows), {"folder": os.path.abspath(args.folder), "skip": args.skip,
                          "epochs": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
