"""Validate ``omnihvd simulate`` against real emulated runs on 4 ranks.

For each scenario it runs a real Horovod job under mpirun (OmniLearnCallback +
HeterogeneousBatchSampler + :class:`omnihvd.tools.emulate.Emulator` in "model" mode, so
rank i's local work per step is ``(step_cost + b_i * sample_cost) / speed_i``), then
simulates the same scenario (same B, policy, cadence, speeds, costs; timing noise
set to what the real run measured) and compares:

* the converged batch sizes (final split),
* the steady-state compute time per step (slowest rank's local time, last quarter),
* the steady-state step time (includes the allreduce: the simulator's ring model
  versus this machine's real, oversubscribed MPI),
* the steps until the final split is first reached, and the number of size changes.

Usage::

    .venv/bin/python benchmarks/validate_simulator.py            # ~2 min, 2 cores
    .venv/bin/python benchmarks/validate_simulator.py --quick    # one scenario

Writes benchmarks/results/validate_simulator.json and prints a Markdown table.
The worker half runs under mpirun: ``validate_simulator.py --worker OPTIONS``.
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from omnihvd.controller import DEFAULT_DEADBAND  # noqa: E402  (pure numpy)

RANKS = 4
SAMPLE_COST = 0.001   # s per sample at speed 1
STEP_COST = 0.010     # fixed s per step at speed 1
SCENARIOS = [
    # name, emulate schedule, simulate profile, policy, steps, adjust_every, B
    ("hl8-affine", "HL8", "hl8", "affine", 240, 20, 256),
    ("hl8-proportional", "HL8", "hl8", "proportional", 240, 20, 256),
    ("dynamic-proportional", "dynamic:60", "dynamic", "proportional", 420, 10, 256),
]


# ------------------------------------------------------------------ worker (mpirun)


def worker(args):
    import torch
    import horovod.torch as hvd
    from mpi4py import MPI

    import omnihvd
    from omnihvd.tools import harness
    from omnihvd.tools.emulate import Emulator

    torch.set_num_threads(1)
    hvd.init()
    rank = hvd.rank()
    B, steps = args.global_batch_size, args.steps
    n_samples = B * (steps + 1)
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(n_samples, 16, generator=gen),
                                          torch.randn(n_samples, 1, generator=gen))
    torch.manual_seed(1)
    model = torch.nn.Linear(16, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B, policy=args.policy,
                                   adjust_every=args.adjust_every, deadband=args.deadband)
    sampler = omnihvd.HeterogeneousBatchSampler(n_samples, cb, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    emu = Emulator(args.schedule, rank, mode="model", sample_cost=SAMPLE_COST,
                   step_cost=STEP_COST)
    records = []  # (step, batch size, local seconds, step seconds)
    with harness.steps(cb, sampler, loader, max_steps=steps, emulator=emu,
                       size=lambda batch: len(batch[0])) as run:
        for step in run:
            x, y = step.batch
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            step.compute_done()
            opt.step()
            step.end()
            # both from before on_batch_begin: local to compute_done, step to on_batch_end's end
            records.append((step.index, step.size, step.t_wait - step.t_begin,
                            step.t_end - step.t_begin))
    everything = MPI.COMM_WORLD.gather({"records": records, "emulator": emu.stats()}, root=0)
    if rank == 0:
        history = [{k: h.get(k) for k in ("step", "sizes", "times", "new_sizes", "changed",
                                           "effective_step")} for h in cb.history]
        with open(args.out, "w") as f:
            json.dump({"ranks": everything, "history": history,
                       "parameter_bytes": sum(p.numel() * p.element_size()
                                              for p in model.parameters())}, f)


# ------------------------------------------------------------------------ driver


def run_real(name, schedule, policy, steps, adjust_every, B, deadband, timeout):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from mpirun import mpirun

    out = os.path.join(tempfile.mkdtemp(prefix="omnihvd-validate-"), name + ".json")
    mpirun(RANKS, os.path.abspath(__file__), "--worker", "--schedule", schedule, "--policy",
           policy, "--steps", steps, "--adjust-every", adjust_every, "--global-batch-size", B,
           "--deadband", deadband, "--out", out, timeout=timeout)
    with open(out) as f:
        return json.load(f)


def analyse_real(doc, speeds_at, steps):
    """Per-step arrays (steps, ranks) of sizes, local and step times; measured noise."""
    sizes = np.zeros((steps, RANKS))
    local = np.zeros((steps, RANKS))
    whole = np.zeros((steps, RANKS))
    for r, part in enumerate(doc["ranks"]):
        for step, b, t_local, t_step in part["records"]:
            sizes[step, r], local[step, r], whole[step, r] = b, t_local, t_step
    speed = np.array([speeds_at(s) for s in range(steps)])
    target = (STEP_COST + sizes * SAMPLE_COST) / speed
    ratio = local / target
    return sizes, local, whole, ratio


def balance(sizes, speed, B):
    """Noise-free balance of each step's split: ideal time / slowest rank's model time."""
    from omnihvd.tools.metrics import balance as split_balance

    return split_balance(sizes, speed / SAMPLE_COST, STEP_COST / speed, global_batch_size=B)


def steps_to_reach(bal, changes, steps, level=0.95):
    """Per phase: steps until the balance first reaches ``level`` (None: never)."""
    bounds = list(changes) + [steps]
    out = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        hit = np.flatnonzero(bal[start:end] >= level)
        out.append(int(hit[0]) if hit.size else None)
    return out


def compare(scenario, deadband, timeout):
    from omnihvd.tools.emulate import parse_schedule
    from omnihvd.tools.simulate import Cluster, Control, make_profile, simulate

    name, schedule, profile_name, policy, steps, adjust_every, B = scenario
    real = run_real(name, schedule, policy, steps, adjust_every, B, deadband, timeout)
    emu_schedule = parse_schedule(schedule, RANKS)
    sizes, local, whole, ratio = analyse_real(real, emu_schedule.speeds_at, steps)
    lo = steps - steps // 4
    # Robust spread (MAD): a few long stalls of an oversubscribed machine should not
    # pass for Gaussian-like noise on every step.
    med = np.median(ratio[1:])
    noise = float(1.4826 * np.median(np.abs(ratio[1:] - med)) / med)
    phase = emu_schedule.changes[0] if emu_schedule.changes else None
    profile = make_profile(profile_name, RANKS, steps, phase_steps=phase)
    cluster = Cluster(ranks=RANKS, throughput=1.0 / SAMPLE_COST, overhead=STEP_COST, noise=noise,
                      gradient_bytes=real["parameter_bytes"])
    sim = simulate(cluster, profile, global_batch_size=B, steps=steps, seed=0,
                   control=Control(policy=policy, adjust_every=adjust_every, deadband=deadband))
    sim_sizes = np.zeros((steps, RANKS))
    sim_sizes[:, sim.tracked_ranks] = sim.tracked_sizes
    real_compute = float(np.mean(local[lo:].max(axis=1)))
    sim_compute = float(np.mean(sim.step_time[lo:] - sim.allreduce_seconds))
    real_step = float(np.mean(whole[lo:].max(axis=1)))
    sim_step = float(np.mean(sim.step_time[lo:]))
    real_final = [int(v) for v in sizes[-1]]
    speed = np.array([emu_schedule.speeds_at(s) for s in range(steps)])
    changes = [0] + list(emu_schedule.changes)
    real_bal, sim_bal = balance(sizes, speed, B), balance(sim_sizes, speed, B)
    return {
        "scenario": name, "schedule": schedule, "policy": policy, "steps": steps,
        "adjust_every": adjust_every, "global_batch_size": B, "deadband": deadband,
        "measured_noise_cv_robust": noise,
        "measured_noise_cv": float(np.std(ratio[1:]) / np.mean(ratio[1:])),
        "measured_mean_local_over_target": float(np.mean(ratio[1:])),
        "emulator_overruns": [p["emulator"]["overruns"] for p in real["ranks"]],
        "real_final_sizes": real_final, "sim_final_sizes": sim.final_sizes,
        "final_sizes_abs_error_samples": int(np.abs(np.array(real_final) - sim.final_sizes).sum()),
        "real_steady_compute_s": real_compute, "sim_steady_compute_s": sim_compute,
        "compute_rel_error": sim_compute / real_compute - 1.0,
        "real_steady_step_s": real_step, "sim_steady_step_s": sim_step,
        "step_rel_error": sim_step / real_step - 1.0,
        "sim_allreduce_s": sim.allreduce_seconds,
        "real_comm_and_wait_s": real_step - real_compute,
        "real_steady_balance": float(np.mean(real_bal[lo:])),
        "sim_steady_balance": float(np.mean(sim_bal[lo:])),
        "real_steps_to_balance_095": steps_to_reach(real_bal, changes, steps),
        "sim_steps_to_balance_095": steps_to_reach(sim_bal, changes, steps),
        "real_size_changes": sum(1 for h in real["history"] if h["changed"]),
        "sim_size_changes": sum(1 for d in sim.decisions if d["changed"]),
    }


def _fmt(values):
    return "/".join("never" if v is None else str(v) for v in values)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default="HL8")
    parser.add_argument("--policy", default="affine")
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--adjust-every", type=int, default=20)
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--deadband", type=float, default=DEFAULT_DEADBAND)
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="first scenario only")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per mpirun")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    load_before = os.getloadavg()
    rows = [compare(s, args.deadband, args.timeout)
            for s in (SCENARIOS[:1] if args.quick else SCENARIOS)]
    load = {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()}
    out = args.out or os.path.join(HERE, "results", "validate_simulator.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"ranks": RANKS, "sample_cost": SAMPLE_COST, "step_cost": STEP_COST,
                   "load_average_1_5_15min": load, "rows": rows}, f, indent=1)
    print("| scenario | final sizes real / sim | compute s/step real / sim (err) | step s real / "
          "sim (err) | steady balance real / sim | steps to balance 0.95 per phase real / sim "
          "| size changes real / sim | noise cv (robust) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| %s | %s / %s | %.4f / %.4f (%+.1f%%) | %.4f / %.4f (%+.1f%%) | %.3f / %.3f "
              "| %s / %s | %d / %d | %.3f |" % (
                  r["scenario"], r["real_final_sizes"], r["sim_final_sizes"],
                  r["real_steady_compute_s"], r["sim_steady_compute_s"],
                  100 * r["compute_rel_error"], r["real_steady_step_s"], r["sim_steady_step_s"],
                  100 * r["step_rel_error"], r["real_steady_balance"], r["sim_steady_balance"],
                  _fmt(r["real_steps_to_balance_095"]), _fmt(r["sim_steps_to_balance_095"]),
                  r["real_size_changes"], r["sim_size_changes"], r["measured_noise_cv_robust"]))
    print("load average (1, 5, 15 min) before %s, after %s, on %d CPUs"
          % (load["before"], load["after"], load["cpus"]))
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
