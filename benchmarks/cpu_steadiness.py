"""How steady is this machine's CPU speed? A fixed busy loop pinned to each CPU, timed
in short windows, alone on one CPU and on all of them at once.

The spread of a benchmark's repeats cannot be smaller than the spread of the CPUs'
own speed. On a virtual machine the host can run a vCPU at different speeds from one
minute to the next (its other hyper-thread busy with another guest, frequency
changes) without any *steal* showing in ``/proc/stat``; this probe measures it
directly, with nothing of the training stack involved::

    flock -x /tmp/omnihvd-cpu.lock .venv/bin/python benchmarks/cpu_steadiness.py \\
        --rounds 10 --out benchmarks/results/cpu-steadiness

Each round runs the loop for ``--seconds`` on each CPU alone, then on every CPU at
once, and records per CPU the median rate over its windows (loop iterations per
second), the hypervisor's steal during the round, and the CPU that other processes
used meanwhile (the machine's busy time minus the probe's own; steal included): a
round slowed by another process is not the CPU changing speed. The report gives each
column's rates over the rounds and their spread: (max - min) / median. Run it alone on
the machine, as the benchmarks run.
"""
import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from typing import Dict, List, Sequence

from realhet import children_cpu, machine_cpu   # /proc/stat (busy, steal); our workers' CPU

CHUNK = 1000   # loop iterations between clock reads


def busy_rates(seconds: float, window: float) -> List[float]:
    """Iterations per second of a busy loop in the calling thread, one rate per
    ``window`` seconds, for ``seconds`` in all (at least one window).

    >>> rates = busy_rates(0.04, 0.02)
    >>> len(rates) >= 1 and min(rates) > 0
    True
    """
    rates, end = [], time.perf_counter() + seconds
    while not rates or time.perf_counter() < end:
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < window:
            for _ in range(CHUNK):
                pass
            n += CHUNK
        rates.append(n / (time.perf_counter() - start))
    return rates


def _worker(cpu, seconds, window, queue):
    os.sched_setaffinity(0, {cpu})   # this worker process only
    queue.put((cpu, busy_rates(seconds, window)))


def run_together(cpus: Sequence[int], seconds: float, window: float) -> Dict[int, float]:
    """Each CPU's median rate while the loop runs on all of ``cpus`` at once (one
    process per CPU)."""
    queue = mp.Queue()
    procs = [mp.Process(target=_worker, args=(c, seconds, window, queue)) for c in cpus]
    for p in procs:
        p.start()
    rates = dict(queue.get(timeout=seconds + 60) for _ in procs)
    for p in procs:
        p.join()
    return {c: statistics.median(r) for c, r in rates.items()}


def spread(values: Sequence[float]) -> float:
    """(max - min) / median.

    >>> spread([1.0, 1.5, 2.0])
    0.6666666666666666
    """
    return (max(values) - min(values)) / statistics.median(values)


def probe(cpus: Sequence[int], rounds: int, seconds: float, window: float,
          pause: float) -> List[dict]:
    """``rounds`` rounds of: the loop alone on each CPU in turn, then on all at once.
    Rates are keyed by the CPU's number as a string, as JSON keeps them."""
    out = []
    for r in range(rounds):
        row = {"t": time.strftime("%H:%M:%S", time.gmtime()), "alone": {}, "together": {}}
        (busy0, steal0), own0 = machine_cpu(), children_cpu()
        for c in cpus:
            row["alone"][str(c)] = run_together([c], seconds, window)[c]
        row["together"] = {str(c): v for c, v in run_together(cpus, seconds, window).items()}
        (busy, steal), own = machine_cpu(), children_cpu()
        row["steal_s"] = round(steal - steal0, 2)
        row["foreign_cpu_s"] = round(max(0.0, busy - busy0 - (own - own0)), 2)
        out.append(row)
        print("%s  alone %s  together %s  steal %.2f s  others %.2f s" % (
            row["t"], " ".join("%.3g" % row["alone"][str(c)] for c in cpus),
            " ".join("%.3g" % row["together"][str(c)] for c in cpus), row["steal_s"],
            row["foreign_cpu_s"]), flush=True)
        if r + 1 < rounds:
            time.sleep(pause)
    return out


def markdown(doc: dict) -> str:
    cpus = doc["cpus"]
    cols = ["alone on CPU %d" % c for c in cpus] + ["CPU %d, all busy" % c for c in cpus]
    series = [[row["alone"][str(c)] for row in doc["rounds"]] for c in cpus] + \
             [[row["together"][str(c)] for row in doc["rounds"]] for c in cpus]
    lines = ["# CPU speed over time: a pinned busy loop", "",
             "Command: `%s`, %s UTC. Rates in million loop iterations per second, each the "
             "median over %g s windows of %g s; one row per round." % (
                 doc["command"], doc["started"], doc["window_s"], doc["seconds"]), "",
             "| round (UTC) | " + " | ".join(cols) + " | steal s | others' CPU s |",
             "|---|" + "---|" * len(cols) + "---|---|"]
    for i, row in enumerate(doc["rounds"]):
        lines.append("| %s | %s | %.2f | %.2f |" % (
            row["t"], " | ".join("%.2f" % (s[i] / 1e6) for s in series), row["steal_s"],
            row["foreign_cpu_s"]))
    lines.append("| **spread** | %s | | |" % " | ".join("%.0f%%" % (100 * spread(s))
                                                       for s in series))
    lines += ["", "Spread: (max - min) / median over the rounds. Slowest round against the "
              "fastest, any column: %.2fx." % (max(max(s) for s in series) /
                                               min(min(s) for s in series))]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--seconds", type=float, default=3.0, help="per column and round")
    p.add_argument("--window", type=float, default=0.5, help="seconds per timed window")
    p.add_argument("--pause", type=float, default=2.0, help="seconds idle between rounds")
    p.add_argument("--out", default=None, help="writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0 or args.window <= 0:
        p.error("--rounds, --seconds and --window must be positive")
    cpus = sorted(os.sched_getaffinity(0))
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    rounds = probe(cpus, args.rounds, args.seconds, args.window, args.pause)
    doc = {"command": "python benchmarks/cpu_steadiness.py " + " ".join(
               "--%s %s" % (k, getattr(args, k)) for k in ("rounds", "seconds", "window", "pause")),
           "started": started, "cpus": cpus, "seconds": args.seconds, "window_s": args.window,
           "rounds": rounds}
    text = markdown(doc)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(doc, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
