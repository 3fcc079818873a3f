"""omnihvd's tools: everything a training run does not need on its hot path.

* :mod:`~omnihvd.tools.cli` -- the ``omnihvd`` command (``doctor``, ``simulate``, ``plot``)
* :mod:`~omnihvd.tools.doctor` -- checks the installation (Horovod, MPI, torch, quotas)
* :mod:`~omnihvd.tools.simulate` -- a cluster rehearsed with the shipped cadence and controller
* :mod:`~omnihvd.tools.emulate` -- heterogeneity emulated inside a rank (sleeps, core sets)
* :mod:`~omnihvd.tools.cpulimits` -- heterogeneity imposed from outside (pinning, cgroup quotas)
* :mod:`~omnihvd.tools.levels` -- the paper's heterogeneity levels, in one place
* :mod:`~omnihvd.tools.metrics` -- the ideal step time and a split's balance
* :mod:`~omnihvd.tools.telemetry` -- run logs, tables and plots
* :mod:`~omnihvd.tools.harness` -- the benchmarks' one training loop (hooks, emulator, timings)
* :mod:`~omnihvd.tools.data`, :mod:`~omnihvd.tools.models` -- Fashion-MNIST and small models
  for the examples and benchmarks

The runtime (what a training step runs) is the package above: ``omnihvd.callback``
wires ``timing`` -> ``comm`` -> ``cadence`` -> ``controller`` -> ``schedule`` ->
``sampler`` and ``weighting``. Nothing there imports from here.
"""
