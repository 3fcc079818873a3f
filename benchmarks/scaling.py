"""Scaling benchmark: the real controller on simulated clusters of 4 to 4096 ranks.

For each n and each policy it runs :func:`omnihvd.tools.simulate.simulate` and records
the controller's decision time (wall time of ``Controller.decide``), the allgather
payload, steps and adjustments to converge, and steady-state efficiency.

Scenarios (B = 64 samples per rank on average):

* ``static``: the paper's HL8 level tiled over n ranks, from an equal split; run
  noise-free (convergence, tolerance 5%) and with 10% timing noise (steady-state
  efficiency over the last quarter; convergence with tolerance 10%).
* ``dynamic``: the paper's HL1 -> HL2 -> HL4 -> HL8 -> HL4 -> HL2 -> HL1 schedule,
  200 steps per level, noise-free (per-phase convergence) and 10% noise (efficiency).

Policies: omnihvd's default (affine, every 20 steps, dead band 0.01, "sustained" timing),
omnihvd with ``policy="proportional"``, and the reference code's policy
(proportional, once per 100-step epoch, dead band 0.2, mean).

The simulator passes the controller each rank's time and error only. What a real run
gathers with the default options also holds each step's release and arrival moments,
each rank's machine, CPUs and kind (release lag, arrival lead, alike ranks), so the
decision is also timed on that (``gathered``): payload rows built as the callback
builds them, read back with :func:`omnihvd.payload.read_gathered` and decided by
:meth:`omnihvd.cadence.Cadence.decide_gathered` (the callback's own call), on
machines of 8 ranks of two GPU generations, the ranks of a machine either each on
their own cores (``pinned``: none alike) or sharing its cores (``shared``: its 8 ranks
alike).

Usage::

    .venv/bin/python benchmarks/scaling.py                 # all n, ~2 min on 1 core
    .venv/bin/python benchmarks/scaling.py --ranks 4 16    # a subset

Writes benchmarks/results/scaling.json, scaling_efficiency.png and
scaling_dynamic_64.png, and prints Markdown tables.
"""
import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from omnihvd.cadence import Cadence, Measurement  # noqa: E402
from omnihvd.controller import DEFAULT_DEADBAND, Controller  # noqa: E402
from omnihvd.payload import payload_row, read_gathered  # noqa: E402
from omnihvd.tools.simulate import (  # noqa: E402
    SUMMARY_FIELDS, Cluster, Control, make_profile, plot, reference_control, simulate)

RANKS = (4, 16, 64, 256, 1024, 4096)
PER_RANK = 64
STATIC_STEPS = 600
PHASE_STEPS = 200
NOISE = 0.1


def policies():
    return {
        "omnihvd-affine": Control(),
        "omnihvd-proportional": Control(policy="proportional"),
        "reference": reference_control(steps_per_epoch=100),
    }


def run_one(n, scenario, control, noise, seed):
    if scenario == "static":
        steps, profile = STATIC_STEPS, make_profile("hl8", n, STATIC_STEPS, seed=seed)
    else:
        steps = PHASE_STEPS * 7
        profile = make_profile("dynamic", n, steps, seed=seed, phase_steps=PHASE_STEPS)
    start = time.perf_counter()
    res = simulate(Cluster(ranks=n, noise=noise), profile, global_batch_size=PER_RANK * n,
                   steps=steps, control=control, seed=seed)
    wall = time.perf_counter() - start
    return res, wall


def decide_profile(n, policy, rounds=10, seed=0, top=6):
    """cProfile of ``Controller.decide`` at n ranks: the functions that cost most."""
    rng = np.random.default_rng(seed)
    ctl = Controller(n, PER_RANK * n, policy=policy, deadband=0.05)
    speed = np.resize(np.array([0.5, 0.5, 1 / 3, 8 / 3]), n)
    sizes = np.full(n, PER_RANK)
    prof = cProfile.Profile()
    for _ in range(rounds):
        times = (0.02 + sizes / (100 * speed)) * rng.lognormal(0, 0.1, n)
        prof.enable()
        sizes = np.asarray(ctl.decide(sizes, times))
        prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    rows = []
    for (path, line, name), (cc, nc, tt, ct, _) in stats.stats.items():
        rows.append({"function": "%s:%d(%s)" % (os.path.basename(path), line, name),
                     "calls_per_decide": nc / rounds, "self_ms_per_decide": 1e3 * tt / rounds,
                     "cumulative_ms_per_decide": 1e3 * ct / rounds})
    rows.sort(key=lambda r: -r["self_ms_per_decide"])
    return rows[:top]


PER_MACHINE = 8
PLACEMENTS = ("pinned", "shared")


def gathered_decisions(n, placement, rounds=12, seed=0, steps=20):
    """CPU time of reading the gathered matrix and deciding, with every input the
    default callback gathers, at ``n`` ranks (see the module's docstring).

    Returns:
        dict: decision CPU ms (median, min, max over ``rounds``), the gathered
        matrix's bytes (what every rank receives per adjustment) and the first
        machine's and second machine's sizes at the end.
    """
    rng = np.random.default_rng(seed)
    B = PER_RANK * n
    cadence = Cadence(Controller(n, B, deadband=DEFAULT_DEADBAND), adjust_every=steps,
                      releases=True, arrived_at=True)
    machine = np.arange(n) // PER_MACHINE
    speed = np.where(machine % 2 == 0, 1.0, 0.5)            # two GPU generations
    if placement == "pinned":
        cpus, kinds = 10.0 + np.arange(n) % PER_MACHINE, 5000.0 + np.arange(n)
    else:
        cpus, kinds = np.full(n, 10.0), 5000.0 + machine
    sizes, step, cpu = [PER_RANK] * n, 0, []
    for _ in range(rounds):
        local = ((0.005 + np.asarray(sizes) * 0.001) / speed
                 * rng.lognormal(0, 0.03, (steps, n)))
        began = 0.2 * (step + np.arange(steps))[:, None]
        released = (began + local.max(axis=1, keepdims=True) + 0.002
                    + rng.uniform(0, 1e-4, (steps, n)))
        matrix = np.array([payload_row(
            Measurement(time=float(local[:, i].mean()), count=steps,
                        error=float(local[:, i].std() / np.sqrt(steps)),
                        releases=released[:, i], arrived_at=began[:, 0] + local[:, i]),
            sizes, i, lookahead=0, cap=B, host=1000.0 + machine[i], cpus=cpus[i],
            kind=kinds[i], steps=steps) for i in range(n)])   # a window's steps, as sent
        step += steps
        start = time.thread_time()
        decision = cadence.decide_gathered(step, read_gathered(matrix, step),
                                           measured_upto=step - 1)
        cpu.append(1e3 * (time.thread_time() - start))
        if decision.changed:
            sizes, step = list(decision.new_sizes), decision.effective_step + 1
    return {"ranks": n, "placement": placement, "decision_cpu_ms_median": float(np.median(cpu)),
            "decision_cpu_ms_min": min(cpu), "decision_cpu_ms_max": max(cpu),
            "gathered_bytes": int(matrix.nbytes),
            "final_sizes_first_two_machines": [sizes[0], sizes[min(PER_MACHINE, n - 1)]]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    load_before = os.getloadavg()
    rows = []
    dynamic_plot = {}
    for n in args.ranks:
        for name, control in policies().items():
            row = {"ranks": n, "policy": name, "global_batch_size": PER_RANK * n,
                   "allgather_bytes": n * SUMMARY_FIELDS * 8}
            clean, _ = run_one(n, "static", control, 0.0, args.seed)
            noisy, wall = run_one(n, "static", control, NOISE, args.seed)
            cs, ns, nr = clean.summary(tol=0.05), noisy.summary(tol=0.10), noisy.summary(tol=0.05)
            row["static"] = {
                "decision_ms_median": ns["decision_ms"]["median"],
                "decision_ms_max": ns["decision_ms"]["max"],
                "decision_cpu_ms_median": ns["decision_ms"]["cpu_median"],
                "decision_cpu_ms_min": ns["decision_ms"]["cpu_min"],
                "steps_to_converge_noise_free": cs["max_steps_to_converge"],
                "adjustments_to_converge_noise_free": cs["max_adjustments_to_converge"],
                "efficiency_noise_free": cs["steady"]["efficiency"],
                "steps_to_converge_noisy_tol10": ns["max_steps_to_converge"],
                "adjustments_to_converge_noisy_tol10": ns["max_adjustments_to_converge"],
                "steps_to_reach_noisy_tol5": nr["max_steps_to_reach"],
                "adjustments_to_reach_noisy_tol5": nr["max_adjustments_to_reach"],
                "efficiency_noisy_vs_noise_free_ideal": ns["steady"]["efficiency"],
                "efficiency_noisy_vs_same_noise_ideal": ns["steady"]["efficiency_same_noise"],
                "noisy_over_noise_free_efficiency":
                    ns["steady"]["efficiency"] / cs["steady"]["efficiency"],
                "balance_noisy": ns["steady"]["balance"],
                "speedup_vs_equal_noisy": ns["steady"]["speedup_vs_equal"],
                "adjustments_noisy": ns["adjustments"], "decisions_noisy": ns["decisions"],
                "simulation_seconds": wall,
            }
            dclean, _ = run_one(n, "dynamic", control, 0.0, args.seed)
            dnoisy, _ = run_one(n, "dynamic", control, NOISE, args.seed)
            conv = dclean.convergence(0.05)
            row["dynamic"] = {
                "phase_steps_to_converge_noise_free": [c["steps"] for c in conv],
                "phase_adjustments_to_converge_noise_free": [c["adjustments"] for c in conv],
                "efficiency_noise_free": dclean.summary()["overall_efficiency"],
                "efficiency_noisy": dnoisy.summary()["overall_efficiency"],
                "efficiency_noisy_same_noise":
                    float(np.sum(dnoisy.oracle_time) / np.sum(dnoisy.step_time)),
                "speedup_vs_equal_noisy":
                    float(np.sum(dnoisy.equal_time) / np.sum(dnoisy.step_time)),
            }
            if n == 64:
                dynamic_plot[name] = dnoisy
            rows.append(row)
            print("n=%5d %-21s decide %7.2f ms (cpu %.2f)  static eff %.3f (same-noise %.3f, "
                  "noise-free %.3f) conv %s steps/%s adj  dynamic eff %.3f  [%.1fs]"
                  % (n, name, row["static"]["decision_ms_median"],
                     row["static"]["decision_cpu_ms_median"],
                     row["static"]["efficiency_noisy_vs_noise_free_ideal"],
                     row["static"]["efficiency_noisy_vs_same_noise_ideal"],
                     row["static"]["efficiency_noise_free"],
                     row["static"]["steps_to_converge_noise_free"],
                     row["static"]["adjustments_to_converge_noise_free"],
                     row["dynamic"]["efficiency_noisy"], wall), flush=True)

    gathered = [gathered_decisions(n, placement, seed=args.seed)
                for n in args.ranks for placement in PLACEMENTS]
    for g in gathered:
        print("n=%5d gathered, %-6s decide cpu %.2f ms (min %.2f, max %.2f), %d bytes"
              % (g["ranks"], g["placement"], g["decision_cpu_ms_median"],
                 g["decision_cpu_ms_min"], g["decision_cpu_ms_max"], g["gathered_bytes"]),
              flush=True)
    big = max(args.ranks)
    profiles = {p: decide_profile(big, p) for p in ("affine", "proportional")}
    doc = {
        "command": "benchmarks/scaling.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"python": platform.python_version(), "numpy": np.__version__,
                    "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(),
                    "load_average_1_5_15min": {"before": load_before, "after": os.getloadavg()}},
        "settings": {"per_rank_batch": PER_RANK, "static_steps": STATIC_STEPS,
                     "phase_steps": PHASE_STEPS, "noise": NOISE, "cluster": vars(Cluster()),
                     "seed": args.seed},
        "rows": rows,
        "gathered": gathered,
        "decide_profile_ranks": big,
        "decide_profile": profiles,
    }
    path = os.path.join(args.out, "scaling.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    _plot_scaling(rows, os.path.join(args.out, "scaling_efficiency.png"))
    if dynamic_plot:
        plot(list(dynamic_plot.values()), os.path.join(args.out, "scaling_dynamic_64.png"),
             labels=list(dynamic_plot))
    print()
    print(markdown(doc))
    print("wrote", path)
    return 0


def _plot_scaling(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for k, name in enumerate(policies()):
        sel = [r for r in rows if r["policy"] == name]
        n = [r["ranks"] for r in sel]
        color = "C%d" % k
        axes[0].plot(n, [r["static"]["decision_cpu_ms_median"] for r in sel], "o-", color=color,
                     label=name)
        axes[1].plot(n, [r["static"]["efficiency_noisy_vs_same_noise_ideal"] for r in sel], "o-",
                     color=color, label="%s (vs same-noise ideal)" % name)
        axes[1].plot(n, [r["static"]["efficiency_noisy_vs_noise_free_ideal"] for r in sel], "x:",
                     color=color, label="%s (vs noise-free ideal)" % name)
    axes[0].axhline(5.0, color="grey", ls="--", lw=0.8)
    axes[0].set(xscale="log", yscale="log", xlabel="ranks", ylabel="Controller.decide, CPU ms",
                title="decision time (target < 5 ms)")
    axes[1].set(xscale="log", xlabel="ranks", ylabel="steady-state efficiency", ylim=(0, 1.05),
                title="HL8, 10% timing noise")
    for ax in axes:
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(v, spec="%.3f"):
    if v is None:
        return "never"
    if isinstance(v, list):
        return "/".join(_fmt(x, "%s") for x in v)
    return spec % v


def markdown(doc) -> str:
    """The Markdown tables of RESULTS.md section 2 from a results document."""
    lines = [
        "| ranks | policy | decide ms: wall median / CPU median / CPU min | allgather B | steps / adj. to converge "
        "(noise-free) | 10% noise: steps / adj. to reach 5% | ... to stay within 10% | "
        "eff. noise-free | eff. 10% noise vs noise-free ideal | vs same-noise ideal | "
        "noisy / noise-free | speed-up vs equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        s = r["static"]
        lines.append("| %d | %s | %s / %s / %s | %d | %s / %s | %s / %s | %s / %s | %s | %s | %s | %s "
                     "| %s |" % (
            r["ranks"], r["policy"], _fmt(s["decision_ms_median"], "%.2f"),
            _fmt(s["decision_cpu_ms_median"], "%.2f"), _fmt(s["decision_cpu_ms_min"], "%.2f"),
            r["allgather_bytes"],
            _fmt(s["steps_to_converge_noise_free"], "%d"),
            _fmt(s["adjustments_to_converge_noise_free"], "%d"),
            _fmt(s["steps_to_reach_noisy_tol5"], "%d"), _fmt(s["adjustments_to_reach_noisy_tol5"], "%d"),
            _fmt(s["steps_to_converge_noisy_tol10"], "%d"),
            _fmt(s["adjustments_to_converge_noisy_tol10"], "%d"),
            _fmt(s["efficiency_noise_free"]), _fmt(s["efficiency_noisy_vs_noise_free_ideal"]),
            _fmt(s["efficiency_noisy_vs_same_noise_ideal"]),
            _fmt(s["noisy_over_noise_free_efficiency"]), _fmt(s["speedup_vs_equal_noisy"], "%.2fx")))
    lines += ["", "| ranks | policy | dynamic: steps per phase to converge (noise-free) | "
                  "adjustments per phase | eff. noise-free | eff. 10% noise | vs same-noise ideal "
                  "| speed-up vs equal |", "|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        d = r["dynamic"]
        lines.append("| %d | %s | %s | %s | %s | %s | %s | %s |" % (
            r["ranks"], r["policy"], _fmt(d["phase_steps_to_converge_noise_free"]),
            _fmt(d["phase_adjustments_to_converge_noise_free"]), _fmt(d["efficiency_noise_free"]),
            _fmt(d["efficiency_noisy"]), _fmt(d["efficiency_noisy_same_noise"]),
            _fmt(d["speedup_vs_equal_noisy"], "%.2fx")))
    lines += ["", "| ranks | placement | gathered decision CPU ms: median / min / max | "
                  "bytes every rank receives |", "|---|---|---|---|"]
    for g in doc.get("gathered", []):
        lines.append("| %d | %s | %.2f / %.2f / %.2f | %d |" % (
            g["ranks"], g["placement"], g["decision_cpu_ms_median"], g["decision_cpu_ms_min"],
            g["decision_cpu_ms_max"], g["gathered_bytes"]))
    lines += ["", "Controller.decide at %d ranks, cProfile, per call:" % doc["decide_profile_ranks"],
              "", "| policy | function | calls | self ms | cumulative ms |", "|---|---|---|---|---|"]
    for policy, prof in doc["decide_profile"].items():
        for p in prof:
            lines.append("| %s | %s | %.0f | %.2f | %.2f |" % (
                policy, p["function"], p["calls_per_decide"], p["self_ms_per_decide"],
                p["cumulative_ms_per_decide"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
