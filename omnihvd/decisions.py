"""What the callback does with a completed gather: read it, lower the memory caps a
rank reported, let the cadence decide, schedule the new sizes, and record the
decision in ``cb.history``.

Every rank runs this on the same gathered matrix, so every rank schedules the same
sizes from the same step. The parts it works on -- the controller, the cadence and
the size schedule -- are passed in at each call: under Horovod elastic the callback
replaces them when the world changes (:mod:`omnihvd.worlds`).
"""
import logging
import time
from typing import Dict, List

from .caps import tighten_caps
from .controller import partial_split
from .payload import read_gathered

__all__ = ["Decisions"]

log = logging.getLogger("omnihvd")


class Decisions:
    """The decisions of one run, and the memory caps in force at each step.

    Args:
        rank: this rank (rank 0 logs the changes).
        options: the resolved options (``release_lag``, ``arrival_lead``,
            ``alike_ranks`` say what each record holds).
        history_size: how many records :attr:`history` keeps.

    >>> Decisions(0, None, history_size=2).history
    []
    """

    def __init__(self, rank: int, options, history_size: int):
        self.rank, self.options, self.history_size = rank, options, history_size
        self.history: List[Dict] = []   # the last history_size decisions
        self.adjustments = 0            # decisions that changed the sizes, all of them
        self.caps_before: list = []     # (from step, the memory caps until then)

    def partial_split(self, controller, sizes, total: int, step: int):
        """An epoch's partial step of ``total`` samples, cut from ``sizes`` within the
        bounds in force at ``step``: memory caps lowered at a decision hold from its
        effective step, as its sizes do, so that a rank whose loader cut this step
        before the decision and one that cuts it after agree."""
        hi = next((before for first, before in self.caps_before if step < first), controller.hi)
        return partial_split(sizes, total, controller.lo, hi, controller.size_multiple)

    def decide(self, matrix, *, step: int, epoch: int, window_end: int, controller, cadence,
               schedule) -> Dict:
        """Decide from the gathered ``matrix`` at ``step`` (the window's last step is
        ``window_end``), schedule the result and return its record."""
        t0 = time.perf_counter()
        got = read_gathered(matrix, step)
        record = {"step": step + 1, "epoch": epoch, "sizes": got.sizes,
                  "times": [float(t) for t in got.times],
                  "samples": [int(c) for c in got.counts]}
        caps_before = controller.hi.copy()
        capped = tighten_caps(controller, got.caps)  # a rank ran out of memory
        if capped:
            record["caps"] = controller.hi.tolist()
            # where the decision's sizes would start: beyond every rank's look-ahead
            self.caps_before.append((step + 1 + max(got.lookahead, 0), caps_before))
        decision = cadence.decide_gathered(step, got, measured_upto=window_end)
        if decision.skipped is not None and capped:
            # no usable timing, but the split must respect the new caps now
            decision = cadence.propose(step, got.sizes, controller.split(schedule.latest),
                                       lookahead=got.lookahead)
        if self.options.release_lag:
            record["lag_charges"] = [float(v) for v in controller.lag_charges()]
        if self.options.arrival_lead:
            record["arrival_lead"] = controller.arrival_lead()
        if self.options.alike_ranks:
            record["alike"] = controller.alike_groups()
        # skipped or held: the split held from now on (not a partial step's sizes)
        record.update(new_sizes=decision.new_sizes or schedule.latest,
                      changed=decision.changed, effective_step=decision.effective_step)
        if decision.skipped is not None:
            record["skipped"] = decision.skipped
        elif decision.changed:
            schedule.change(decision.effective_step, decision.new_sizes)
            self._log_change(step, got, decision, controller, capped)
        if cadence.tuner is not None:
            self._record_tilt(record, step, cadence.tuner.tilt, got.periods)
        record["decision_s"] = time.perf_counter() - t0
        self.adjustments += decision.changed
        self.history.append(record)
        if len(self.history) > self.history_size:
            del self.history[0]  # history_size pointers moved: cheap, and memory stays flat
        return record

    def _record_tilt(self, record, step, tilt, periods):
        before = self.history[-1].get("tilt", 0.0) if self.history else 0.0
        if self.rank == 0 and tilt != before:
            log.info("omnihvd: step %d: split tilt %+.2f -> %+.2f (step periods %s s)",
                     step + 1, before, tilt, ", ".join("%.4g" % p for p in periods))
        record.update(tilt=tilt, periods=[float(p) for p in periods])

    def _log_change(self, step, got, decision, controller, capped):
        if self.rank != 0:
            return
        charges, lead = controller.lag_charges(), controller.arrival_lead()
        alike = controller.alike_groups()
        log.info("omnihvd: step %d: batch sizes %s -> %s from step %d (times %s%s%s%s%s)",
                 step + 1, got.sizes, decision.new_sizes, decision.effective_step,
                 ", ".join("%.4g" % t for t in got.times),
                 "; release lags +%s" % ", ".join("%.4g" % c for c in charges) if charges.any()
                 else "", "; arrival lead %.4g" % lead if lead else "",
                 "; alike ranks %s" % " ".join(",".join(map(str, g)) for g in alike)
                 if alike else "",
                 "; memory caps %s" % controller.hi.tolist() if capped else "")
