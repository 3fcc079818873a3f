"""Run logs, plots, a progress bar and tables: what a person looks at after a run.

A run log is a JSON-lines file. The first record describes the run; then one record
per step; other records carry events::

    {"kind": "meta", "run": "HL4 omnihvd", "changes": [300], "labels": ["HL4", "HL8"], ...}
    {"kind": "step", "step": 0, "t": 0.12, "step_s": 0.12, "sizes": [64, 64, 64, 64],
     "times": [0.09, 0.09, 0.13, 0.03], "ideal_s": 0.06}
    {"kind": "eval", "step": 233, "t": 30.1, "accuracy": 0.861}

``times`` are the ranks' local compute times (up to the point where each starts
waiting for the others) and ``ideal_s`` is ``B / sum_i(b_i / t_i)``: the step time if
the batch were split in proportion to the measured throughputs. :func:`plot_logs`
draws per-rank batch sizes over the steps with the heterogeneity changes marked, and
the step time against the ideal; ``omnihvd plot LOG...`` does the same from a shell.
matplotlib is imported only when plotting, with the non-interactive Agg backend.
"""
import json
import math
import os
import sys
import time
from typing import Iterable, List, Optional, Sequence

from ..errors import ConfigError
from .metrics import measured_ideal_step_time

__all__ = ["RunLog", "read_log", "ideal_step_time", "summarize", "plot_logs", "ProgressBar",
           "format_table", "configure_parser", "run"]


# ``B / sum_i(b_i / t_i)`` of a step record: omnihvd.tools.metrics holds the definition.
ideal_step_time = measured_ideal_step_time


class RunLog:
    """Write a run log (JSON lines). Use as a context manager, on one rank only.

    Args:
        path: file to create (its folder is created too); ``"-"`` writes nowhere.
        **meta: fields of the first record (``run``, ``changes``, ``labels``, ...).

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "run.log")
    >>> with RunLog(path, run="demo", changes=[2]) as log:
    ...     for k in range(4):
    ...         log.step(k, t=0.1 * (k + 1), step_s=0.1, sizes=[2, 2], times=[0.05, 0.1])
    >>> round(read_log(path)["steps"][3]["ideal_s"], 4)
    0.0667
    """

    def __init__(self, path: str, **meta):
        self.path = path
        self._file = None
        if path != "-":
            folder = os.path.dirname(os.path.abspath(path))
            os.makedirs(folder, exist_ok=True)
            self._file = open(path, "w")
        self.write(dict(kind="meta", **meta))

    def write(self, record: dict):
        """Append one record (any JSON-serialisable dict with a ``kind``)."""
        if self._file is not None:
            self._file.write(json.dumps(record, separators=(",", ":"), default=_jsonable) + "\n")

    def step(self, step: int, *, t: float, step_s: float, sizes, times=None, **extra):
        """Append a step record; ``ideal_s`` is computed when ``times`` are given."""
        record = dict(kind="step", step=int(step), t=float(t), step_s=float(step_s),
                      sizes=[int(b) for b in sizes])
        if times is not None:
            record["times"] = [float(x) for x in times]
            record["ideal_s"] = ideal_step_time(record["sizes"], record["times"])
        record.update(extra)
        self.write(record)

    def event(self, kind: str, step: int, **fields):
        """Append an event record, e.g. ``event("eval", 233, t=30.1, accuracy=0.86)``."""
        self.write(dict(kind=kind, step=int(step), **fields))

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _jsonable(value):
    if hasattr(value, "tolist"):     # numpy arrays and scalars
        return value.tolist()
    raise TypeError("cannot write %r to a run log" % (value,))


def read_log(path: str) -> dict:
    """Read a run log into ``{"meta": dict, "steps": [...], "events": [...]}``.

    Raises:
        ConfigError: the file is missing, empty, or a line is not JSON (quoting the line).
    """
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as exc:
        raise ConfigError("cannot read run log %s: %s" % (path, exc.strerror)) from None
    out = {"meta": {}, "steps": [], "events": []}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ConfigError("%s line %d is not JSON: %.60r; is this a run log written by "
                              "omnihvd.tools.telemetry.RunLog?" % (path, number, line)) from None
        problem = _record_problem(record)
        if problem:
            raise ConfigError("%s line %d: %s: %.60r; is this a run log written by "
                              "omnihvd.tools.telemetry.RunLog?" % (path, number, problem, line))
        kind = record.get("kind")
        if kind == "meta":
            out["meta"].update(record)
        elif kind == "step":
            out["steps"].append(record)
        else:
            out["events"].append(record)
    if not out["meta"] and not out["steps"]:
        raise ConfigError("run log %s holds no records" % path)
    return out


def _record_problem(record) -> str:
    """What keeps ``record`` from being a run-log record ('' when it is one).

    >>> _record_problem([1, 2]), _record_problem({"kind": "step", "step": 0})
    ('not a JSON object', 'a step record needs step, t, step_s and sizes')
    >>> _record_problem({"kind": "step", "step": 0, "t": 1, "step_s": "abc", "sizes": [2]})
    'step_s must be a number'
    """
    if not isinstance(record, dict):
        return "not a JSON object"
    if record.get("kind") != "step":
        return ""
    if any(key not in record for key in ("step", "t", "step_s", "sizes")):
        return "a step record needs step, t, step_s and sizes"
    for key in ("step", "t", "step_s", "ideal_s"):
        value = record.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "%s must be a number" % key
    sizes = record["sizes"]
    if not (isinstance(sizes, list) and sizes
            and all(isinstance(b, int) and not isinstance(b, bool) for b in sizes)):
        return "sizes must be a list of ints"
    return ""


def _converged_at(sizes, tolerance, slack):
    """First row index from which every row stays within tolerance of the last row."""
    import numpy as np

    final = sizes[-1]
    limit = np.maximum(tolerance * final, slack)
    inside = np.all(np.abs(sizes - final) <= limit, axis=1)
    outside = np.flatnonzero(~inside)
    return int(outside[-1]) + 1 if outside.size else 0


def summarize(steps: Sequence[dict], changes: Sequence[int] = (), *, tolerance: float = 0.05,
              slack: int = 2, settle: int = 2, warmup: int = 3) -> List[dict]:
    """Per-segment figures of a run: convergence, and step times once converged.

    The run is cut at the heterogeneity ``changes``. In each segment the batch sizes
    have *converged* at the first step from which every later step's sizes stay
    within ``tolerance`` (relative, but at least ``slack`` samples) of the segment's
    final sizes. The steady window starts ``settle`` steps after that (and at least
    ``warmup`` steps into the run); step and ideal times are means over it (a median
    would leave out the steps that gather and decide), ``hooks_s`` a median.

    Args:
        steps: step records as written by :meth:`RunLog.step` (``step``, ``t``,
            ``step_s``, ``sizes``, optional ``times``, ``ideal_s``, ``hooks_s``).
        changes: steps at which the speeds changed.

    Returns:
        One dict per segment: ``start``, ``end`` (steps), ``adjustments`` (size
        changes in the segment), ``adjustments_to_converge``, ``steps_to_converge``,
        ``seconds_to_converge``, ``step_s``, ``ideal_s``, ``efficiency``
        (ideal / step), ``hooks_s``, ``sizes`` (final), ``window`` (steps used).

    >>> recs = [dict(step=k, t=0.1 * k, step_s=0.1, sizes=[64, 64] if k < 3 else [32, 96],
    ...              ideal_s=0.1) for k in range(10)]
    >>> seg = summarize(recs)[0]
    >>> seg["adjustments_to_converge"], seg["steps_to_converge"], seg["window"]
    (1, 3, 5)
    """
    import numpy as np

    if not steps:
        return []
    ordered = sorted(steps, key=lambda r: r["step"])
    index = np.array([r["step"] for r in ordered])
    bounds = [int(index[0])] + [c for c in sorted(changes) if index[0] < c <= index[-1]] + \
        [int(index[-1]) + 1]
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        rows = [r for r in ordered if lo <= r["step"] < hi]
        if not rows:
            continue
        sizes = np.array([r["sizes"] for r in rows], dtype=float)
        moved = np.any(sizes[1:] != sizes[:-1], axis=1)
        conv = _converged_at(sizes, tolerance, slack)
        first = max(conv + settle if conv else 0, warmup - (lo - int(index[0])), 0)
        if len(rows) - first < max(5, len(rows) // 4):   # never settled: use the last quarter
            first = len(rows) - max(len(rows) // 4, 1)
        window = rows[first:]
        begin = rows[0]["t"] - rows[0]["step_s"]

        def over_window(key, summary):
            vals = [r[key] for r in window if r.get(key) is not None]
            vals = [v for v in vals if math.isfinite(v)]
            return float(summary(vals)) if vals else float("nan")

        # means, not medians: a median would leave out the steps that gather and decide
        step_s, ideal_s = over_window("step_s", np.mean), over_window("ideal_s", np.mean)
        out.append({
            "start": lo, "end": hi,
            "adjustments": int(moved.sum()),
            "adjustments_to_converge": int(moved[:conv].sum()) if conv else 0,
            "steps_to_converge": conv,
            "seconds_to_converge": float(rows[conv - 1]["t"] - begin) if conv else 0.0,
            "step_s": step_s, "ideal_s": ideal_s,
            "efficiency": ideal_s / step_s if step_s > 0 else float("nan"),
            # the hooks of a typical step: a mean would add the waits for the peers at
            # the steps that gather, which are not the hooks' own cost
            "hooks_s": over_window("hooks_s", np.median),
            "sizes": [int(b) for b in sizes[-1]],
            "window": len(window),
        })
    return out


def _rolling_median(values: List[float], window: int) -> List[float]:
    import numpy as np

    arr = np.asarray(values, dtype=float)
    half = window // 2
    return [float(np.nanmedian(arr[max(0, k - half):k + half + 1])) for k in range(len(arr))]


def _mark_changes(ax, meta, steps_range):
    changes = list(meta.get("changes") or [])
    labels = list(meta.get("labels") or [])
    for step in changes:
        ax.axvline(step, color="0.4", linestyle="--", linewidth=1)
    if labels and len(labels) == len(changes) + 1:
        starts = [0] + changes
        ends = changes + [steps_range]
        for label, lo, hi in zip(labels, starts, ends):
            ax.text((lo + hi) / 2, 1.01, label, transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=8, color="0.3")


def plot_logs(paths: Sequence[str], out_dir: Optional[str] = None, prefix: Optional[str] = None,
              smooth: int = 9) -> List[str]:
    """Render PNG plots from run logs.

    ``<prefix>-batch-sizes.png`` (per-rank batch sizes of the first log whose sizes
    vary, heterogeneity changes marked), ``<prefix>-step-time.png`` (the step time
    of every log, rolling median over ``smooth`` steps, against the ideal) and, when
    the logs hold ``eval`` events, ``<prefix>-accuracy.png`` (test accuracy against
    training time).

    Args:
        paths: one or more run logs (e.g. plain Horovod and omnihvd of one level).
        out_dir: folder for the PNGs (default: the first log's folder).
        prefix: file-name prefix (default: the first log's name without extension,
            with a trailing "-plain" or "-omnihvd" left off: the plots show all the logs).
        smooth: rolling-median window for the step times.

    Returns:
        The paths of the files written.

    Raises:
        ConfigError: no logs, or a log without step records.
    """
    if not paths:
        raise ConfigError("plot_logs needs at least one run log")
    logs = [read_log(p) for p in paths]
    for path, log in zip(paths, logs):
        if not log["steps"]:
            raise ConfigError("run log %s has no step records to plot" % path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = out_dir or os.path.dirname(os.path.abspath(paths[0]))
    if prefix is None:
        prefix = os.path.splitext(os.path.basename(paths[0]))[0]
        for variant in ("-plain", "-omnihvd"):
            if len(paths) > 1 and prefix.endswith(variant):
                prefix = prefix[:-len(variant)]
    os.makedirs(out_dir, exist_ok=True)
    written = []

    # Batch sizes: the first log whose sizes change (omnihvd), else the first.
    sized = next((log for log in logs if len({tuple(s["sizes"]) for s in log["steps"]}) > 1), logs[0])
    steps = [s["step"] for s in sized["steps"]]
    sizes = list(zip(*[s["sizes"] for s in sized["steps"]]))
    fig, ax = plt.subplots(figsize=(9, 4))
    speeds = sized["meta"].get("speeds")
    for rank, series in enumerate(sizes):
        ax.step(steps, series, where="post", label="rank %d" % rank)
    _mark_changes(ax, sized["meta"], steps[-1] + 1)
    ax.set_xlabel("step")
    ax.set_ylabel("batch size")
    ax.set_title("Per-rank batch sizes: %s" % sized["meta"].get("run", ""), pad=14)
    ax.legend(loc="upper left", fontsize=8, ncol=len(sizes))
    if speeds:
        ax.text(0.99, 0.02, "speeds at start: %s" % ", ".join("%g" % v for v in speeds[0]),
                transform=ax.transAxes, ha="right", fontsize=8, color="0.3")
    fig.tight_layout()
    path = os.path.join(out_dir, prefix + "-batch-sizes.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    # Step time against the ideal.
    fig, ax = plt.subplots(figsize=(9, 4))
    ideal_drawn = False
    for log in logs:
        steps = [s["step"] for s in log["steps"]]
        name = log["meta"].get("variant") or log["meta"].get("run", "run")
        ax.plot(steps, _rolling_median([s["step_s"] for s in log["steps"]], smooth), label=name)
        ideal = [s.get("ideal_s", float("nan")) for s in log["steps"]]
        if not ideal_drawn and any(math.isfinite(v) for v in ideal) and \
                len({tuple(s["sizes"]) for s in log["steps"]}) > 1:
            ax.plot(steps, _rolling_median(ideal, smooth), "k--", linewidth=1,
                    label="ideal B/sum(x_i)")
            ideal_drawn = True
    if not ideal_drawn:   # no balanced run: take the first log's ideal
        log = logs[0]
        ax.plot([s["step"] for s in log["steps"]],
                _rolling_median([s.get("ideal_s", float("nan")) for s in log["steps"]], smooth),
                "k--", linewidth=1, label="ideal B/sum(x_i)")
    _mark_changes(ax, logs[0]["meta"], max(s["step"] for log in logs for s in log["steps"]) + 1)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (s), rolling median")
    ax.set_ylim(bottom=0)
    ax.set_title("Step time vs ideal: %s" % logs[0]["meta"].get("level", ""), pad=14)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, prefix + "-step-time.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    # Test accuracy against training time, when the logs hold evaluations.
    evaluated = [log for log in logs if any(e["kind"] == "eval" for e in log["events"])]
    if evaluated:
        fig, ax = plt.subplots(figsize=(9, 4))
        for log in evaluated:
            evals = [e for e in log["events"] if e["kind"] == "eval"]
            ax.plot([e["t"] for e in evals], [e["accuracy"] for e in evals], marker=".",
                    label=log["meta"].get("run") or log["meta"].get("variant", "run"))
        target = logs[0]["meta"].get("target")
        if target:
            ax.axhline(target, color="0.4", linestyle=":", linewidth=1, label="target")
        ax.set_xlabel("training time (s), evaluation excluded")
        ax.set_ylabel("test accuracy")
        ax.set_title("Time to accuracy: %s" % logs[0]["meta"].get("level", ""))
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, prefix + "-accuracy.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


class ProgressBar:
    """A one-line progress bar for long runs (rank 0 only; pass ``enabled=False`` elsewhere).

    On a terminal the line is redrawn in place; otherwise (CI logs) a line is printed
    at every 10% so logs stay short.

    >>> import io
    >>> out = io.StringIO()
    >>> bar = ProgressBar(4, "HL4 plain", stream=out)
    >>> for _ in range(4): bar.update(step_s=0.1)
    >>> bar.close(); "4/4" in out.getvalue()
    True
    """

    def __init__(self, total: int, label: str = "", *, stream=None, enabled: bool = True,
                 width: int = 24):
        self.total = max(int(total), 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.count = 0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._next_report = 0.0
        self._begin = time.perf_counter()
        self._last_step = float("nan")

    def update(self, n: int = 1, step_s: Optional[float] = None, **info):
        """Advance by ``n`` steps; ``step_s`` and ``info`` are shown on the line."""
        self.count = min(self.count + n, self.total)
        if step_s is not None:
            self._last_step = step_s
        if not self.enabled:
            return
        fraction = self.count / self.total
        if not self._tty and fraction < self._next_report and self.count < self.total:
            return
        self._next_report = math.floor(fraction * 10 + 1e-9) / 10 + 0.1
        filled = int(round(self.width * fraction))
        extra = "".join(" %s=%s" % kv for kv in info.items())
        line = "%s |%s%s| %d/%d %.0fs %.3f s/step%s" % (
            self.label, "#" * filled, "-" * (self.width - filled), self.count, self.total,
            time.perf_counter() - self._begin, self._last_step, extra)
        self.stream.write(("\r" + line + "\033[K") if self._tty else line + "\n")
        self.stream.flush()

    def close(self):
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()


def format_table(rows: Iterable[dict], columns: Sequence[tuple]) -> str:
    """Format dicts as a fixed-width text table.

    Args:
        rows: one dict per row.
        columns: ``(key, heading, format)`` triples; format is a %-format such as
            ``"%.3f"``; missing or None values print as ``-``.

    >>> print(format_table([{"a": "HL1", "b": 0.5}], [("a", "level", "%s"), ("b", "s", "%.2f")]))
    level     s
    -----  ----
    HL1    0.50
    """
    cells = [[heading for _, heading, _ in columns]]
    for row in rows:
        line = []
        for key, _, fmt in columns:
            value = row.get(key)
            ok = value is not None and not (isinstance(value, float) and math.isnan(value))
            line.append(fmt % value if ok else "-")
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    out = []
    for k, line in enumerate(cells):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(line, widths))).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


# ------------------------------------------------------------ `omnihvd plot`


def configure_parser(parser):
    """Options of ``omnihvd plot``."""
    parser.add_argument("logs", nargs="+", metavar="LOG",
                        help="run logs (JSON lines); several are overlaid in the step-time plot")
    parser.add_argument("--out", metavar="DIR", help="folder for the PNGs (default: the first "
                        "log's folder)")
    parser.add_argument("--prefix", help="file-name prefix (default: the first log's name)")
    parser.add_argument("--smooth", type=int, default=9, help="rolling-median window (steps)")


def run(args) -> int:
    """``omnihvd plot``: render the PNGs and print their paths."""
    try:
        paths = plot_logs(args.logs, args.out, args.prefix, args.smooth)
    except ConfigError as exc:
        print("omnihvd plot: %s" % exc, file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
