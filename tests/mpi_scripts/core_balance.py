"""Balance check under mpirun: ranks made slower by known factors converge to the
proportional split, and the step time approaches the ideal.

Rank i's local work per step is a sleep of FIXED + b_i * PER_SAMPLE / speed_i (plus a
tiny real forward/backward), so the true throughputs are known exactly.

Usage: core_balance.py SPEEDS POLICY STEPS [FIXED_MS [INITIAL_SIZES]]
Prints one line "BALANCE {json}" on rank 0.
"""
import hashlib
import json
import sys
import time

import torch
import horovod.torch as hvd

import omnihvd

speeds = [float(s) for s in sys.argv[1].split(",")]
policy, steps = sys.argv[2], int(sys.argv[3])
fixed = float(sys.argv[4]) / 1000 if len(sys.argv) > 4 else 0.0
initial = [int(b) for b in sys.argv[5].split(",")] if len(sys.argv) > 5 else None
PER_SAMPLE = 0.002  # seconds per sample at speed 1
B = 70
torch.set_num_threads(1)
hvd.init()
rank, size = hvd.rank(), hvd.size()
speed = speeds[rank % len(speeds)]

model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
adjust = steps + 1 if policy == "none" else 10
cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B, adjust_every=adjust,
                               policy={"none": "proportional", "tuned": "affine"}.get(policy,
                                                                                      policy),
                               tune_split=policy == "tuned", balance_arrivals=True,
                               arrival_lead=True, initial_batch_sizes=initial)
cb.on_train_begin()
ends, derivatives = [], []
for step in range(steps):
    cb.on_batch_begin()
    b = cb.batch_size
    # the work before the backward pass, as real compute comes before the gradients:
    # the allreduce then waits for it, and each step holds the ranks together (a
    # sleep after backward() would let the allreduce complete during it, and the
    # arrival lead leaves such steps out: omnihvd.lead.HELD_SLACK)
    time.sleep(fixed + b * PER_SAMPLE / speed)
    opt.zero_grad()
    model(torch.randn(b, 4)).pow(2).mean().backward()
    opt.step()
    decisions = len(cb.history)
    cb.on_batch_end()
    ends.append(time.perf_counter())
    if len(cb.history) > decisions:   # the lead's D = P_L - w_L after each decision
        derivatives.append(cb.controller._lead.derivative[0])
cb.on_train_end()

# balance_arrivals=True (under sleeps it gains less than MIN_GAIN and keeps the split of
# equal means) and arrival_lead=True: every rank gathered the same per-step times and
# moments and so holds the same pool and lead, and took the same decisions
pool = cb.controller._arrivals.residuals()
leads = [h["arrival_lead"] for h in cb.history]
# alike_ranks=True (the default): every rank runs on this machine's CPUs, no quota, so
# all are of one kind until their times tell them apart
alike = [h["alike"] for h in cb.history]
mine = (None if pool is None else hashlib.sha256(pool.tobytes()).hexdigest(),
        json.dumps([h["new_sizes"] for h in cb.history]), json.dumps(leads), json.dumps(alike))
everyone = hvd.allgather_object(mine)

if rank == 0:
    x = [s / PER_SAMPLE for s in speeds[:size]]
    ideal = fixed + B / sum(x)
    tail = ends[-30:]
    measured = (tail[-1] - tail[0]) / (len(tail) - 1)
    target = omnihvd.controller.apportion(x, B)
    changes = [h["step"] for h in cb.history if h["changed"]]
    print("BALANCE " + json.dumps({
        "speeds": speeds[:size], "policy": policy, "final_sizes": cb.batch_sizes,
        # under tune_split the last window may be a probe of a tilted split: the split
        # it holds is the controller's at the tilt it keeps
        "held_sizes": (cb.batch_sizes if cb.cadence.tuner is None
                       else cb.controller.split_at(cb.cadence.tuner.tilt)),
        "proportional_sizes": target, "measured_step_s": measured, "ideal_step_s": ideal,
        "efficiency": ideal / measured, "adjustments": len(changes), "change_steps": changes,
        "overhead_per_step_s": cb.overhead_per_step,
        "decision_s": max((h["decision_s"] for h in cb.history), default=0.0),
        "tilts": [h.get("tilt") for h in cb.history],
        "arrival_rows": 0 if pool is None else len(pool), "leads": leads,
        # NaN where no rank was led or the lead restarted (a speed change seen, as a
        # tune_split probe far from the fitted sizes may show)
        "lead_derivatives": derivatives, "alike": alike,
        "ranks_agree": all(e == everyone[0] for e in everyone)}))
