"""What ``tune_split`` gains, and costs, in the simulator: seconds, not minutes.

Each scenario runs the simulator (:func:`omnihvd.tools.simulate.simulate`) twice
with the same seed and noise, with and without ``tune_split``, and reports the
tuned run's mean step time over the untuned one's in three stretches of the run
(below 1: tuning gains). Scenarios:

* ``3:1:1:1 unseen U``: one rank three times as fast as three others, whose step
  is ``1 + U`` times their local time (costs no local time shows: what the search
  is for); U = 0 shows what the probes cost where local times tell all. At U = 0.8
  the best tilt lies near 0.6-0.8, far from where the search starts.
* ``HL2`` / ``HL4`` / ``HL8``: the paper's levels on 8 ranks, nothing unseen.

Usage::

    .venv/bin/python benchmarks/tune_split_sim.py                    # ~10 s
    .venv/bin/python benchmarks/tune_split_sim.py --code OTHER_TREE  # another version
    .venv/bin/python benchmarks/tune_split_sim.py --out results.json

Pure numpy: no MPI, torch or Horovod.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

STRETCHES = ((0, 300), (300, 600), (600, None))   # steps [lo, hi) of each ratio
STEPS = 1500
BATCH = 256


def scenarios(simulate_module):
    """(name, cluster, profile) of every scenario."""
    Cluster, SpeedProfile = simulate_module.Cluster, simulate_module.SpeedProfile
    three_to_one = SpeedProfile.constant("3:1:1:1", [3.0, 1.0, 1.0, 1.0])
    for unseen in (0.0, 0.2, 0.8):
        yield ("3:1:1:1 unseen %.1f" % unseen,
               Cluster(ranks=4, noise=0.1, unseen=[0.0, unseen, unseen, unseen],
                       overhead=0.002, throughput=2000.0), three_to_one)
    for level in ("hl2", "hl4", "hl8"):
        yield level.upper(), Cluster(ranks=8, noise=0.1), level


def compare(simulate_module, cluster, profile, seed, **control):
    """Tuned over untuned mean step time per stretch, and the tuned final sizes
    (``control``: other :class:`Control` fields, the same for both)."""
    runs = [simulate_module.simulate(cluster, profile, global_batch_size=BATCH, steps=STEPS,
                                     seed=seed,
                                     control=simulate_module.Control(tune_split=tune, **control))
            for tune in (True, False)]
    ratios = [float(runs[0].step_time[lo:hi].mean() / runs[1].step_time[lo:hi].mean())
              for lo, hi in STRETCHES]
    return ratios, runs[0].final_sizes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--code", default=ROOT, help="the tree whose omnihvd to import")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.code))
    from omnihvd.tools import simulate as simulate_module

    stretches = ["%d-%s" % (lo, hi if hi is not None else STEPS) for lo, hi in STRETCHES]
    tree = os.path.dirname(os.path.dirname(os.path.dirname(simulate_module.__file__)))
    version = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip() or "unknown"
    print("code: %s at %s" % (tree, version))
    print("| scenario | seed | tuned / untuned, steps %s | tuned final sizes |"
          % " / ".join(stretches))
    print("|---|---|---|---|")
    rows = []
    for name, cluster, profile in scenarios(simulate_module):
        for seed in range(args.seeds):
            ratios, sizes = compare(simulate_module, cluster, profile, seed)
            rows.append({"scenario": name, "seed": seed, "ratios": ratios, "final_sizes": sizes})
            print("| %s | %d | %s | %s |" % (name, seed, " / ".join("%.3f" % r for r in ratios),
                                             ",".join(map(str, sizes))), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python benchmarks/tune_split_sim.py " + " ".join(
                argv if argv is not None else sys.argv[1:]), "code_version": version,
                "stretches": stretches, "steps": STEPS, "global_batch_size": BATCH,
                "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
