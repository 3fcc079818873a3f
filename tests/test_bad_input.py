"""Bad input at the public entry points: a ValueError subclass whose message names the value.

This file covers what the per-module tests do not (test_controller.py,
test_sampler.py, test_callback_single.py, test_emulate.py, test_timing.py,
test_elastic.py, test_faults.py and test_data.py have their own bad-input tables):
non-finite and wrongly typed callback options, ``report_oom``, malformed
checkpoints, emulation options from the environment and the command line. Timing
garbage on one rank and ranks resumed from different checkpoints, under a real
mpirun, are in test_bad_input_mpi.py.

The last cases of ``CASES`` were once strict xfails (accepted, or failing with an
error that is not one of omnihvd's ValueError subclasses); they are fixed now.
"""
import argparse
import math
import os

import pytest
import torch

import horovod.torch as hvd
import omnihvd
from omnihvd.tools import cli, emulate, levels, models, telemetry
from omnihvd.errors import ConfigError, InfeasibleError, OmniHvdError
from omnihvd.sampler import HeterogeneousBatchSampler, StaticSchedule

pytestmark = [pytest.mark.single, pytest.mark.usefixtures("horovod")]
B = 8


def callback(**options):
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    options.setdefault("global_batch_size", B)
    return omnihvd.OmniLearnCallback(model, opt, **options)


def state(**changes):
    """A valid one-rank callback checkpoint with ``changes`` applied."""
    return dict({"version": 1, "global_batch_size": B, "num_ranks": 1, "step": 3, "epoch": 0,
                 "batch_sizes": [B], "changes": [], "controller": {}}, **changes)


def sampler(**options):
    return HeterogeneousBatchSampler(10, StaticSchedule([5]), **options)


def emulation(**environ):
    parser = argparse.ArgumentParser()
    emulate.add_arguments(parser)
    args = parser.parse_args([])
    return emulate.from_args(args, 0, 2, environ=dict({"OMNIHVD_EMULATE": "1,1"}, **environ))


# (id, call, error type, text the message must contain: the value, and the option)
CASES = [
    # OmniLearnCallback options beyond test_callback_single.py's table
    ("deadband-nan", lambda: callback(deadband=math.nan), ConfigError, "deadband", "nan"),
    ("deadband-inf", lambda: callback(deadband=math.inf), ConfigError, "deadband", "inf"),
    ("deadband-str", lambda: callback(deadband="0.1"), ConfigError, "deadband", "'0.1'"),
    ("gain-inf", lambda: callback(gain=math.inf), ConfigError, "gain", "inf"),
    ("gain-nan", lambda: callback(gain=math.nan), ConfigError, "gain", "nan"),
    ("settle-float", lambda: callback(settle_steps=1.0), ConfigError, "settle_steps", "1.0"),
    ("settle-bool", lambda: callback(settle_steps=True), ConfigError, "settle_steps", "True"),
    ("timing-none", lambda: callback(timing=None), ConfigError, "timing", "None"),
    ("min-bool-list", lambda: callback(min_batch_size=[True]), ConfigError, "min_batch_size", "[True]"),
    ("min-negative", lambda: callback(min_batch_size=-1), ConfigError, "min_batch_size", "-1"),
    ("min-float", lambda: callback(min_batch_size=1.5), ConfigError, "min_batch_size", "1.5"),
    ("max-zero", lambda: callback(max_batch_size=0), ConfigError, "max_batch_size", "0"),
    ("max-str", lambda: callback(max_batch_size="8"), ConfigError, "max_batch_size", "'8'"),
    ("initial-negative", lambda: callback(initial_batch_sizes=[-8]), ConfigError,
     "initial_batch_sizes", "[-8]"),
    ("initial-none", lambda: callback(initial_batch_sizes=[None]), ConfigError,
     "initial_batch_sizes", "[None]"),
    ("initial-str", lambda: callback(initial_batch_sizes="8"), ConfigError,
     "initial_batch_sizes", "'8'"),
    ("global-float", lambda: callback(global_batch_size=1e9), ConfigError,
     "global_batch_size", "1000000000.0"),
    # report_oom
    ("oom-shrink-0", lambda: callback().report_oom(shrink=0), ConfigError, "shrink", "0"),
    ("oom-shrink-1.5", lambda: callback().report_oom(shrink=1.5), ConfigError, "shrink", "1.5"),
    ("oom-shrink-nan", lambda: callback().report_oom(shrink=math.nan), ConfigError, "shrink", "nan"),
    ("oom-at-minimum", lambda: callback(global_batch_size=1).report_oom(), InfeasibleError,
     "rank 0", "batch size 1"),
    # checkpoints
    ("cb-state-none", lambda: callback().load_state_dict(None), ConfigError, "state_dict", "None"),
    # flags, communicators and checkpoints (gaps this file found, fixed in a094355)
    ("nonblocking-str", lambda: callback(nonblocking="no"), ConfigError, "nonblocking", "'no'"),
    ("comm-int", lambda: callback(comm=42), ConfigError, "comm", "42"),
    ("oom-shrink-str", lambda: callback().report_oom(shrink="0.5"), ConfigError, "shrink", "'0.5'"),
    ("cb-state-negative-step", lambda: callback().load_state_dict(state(step=-3)), ConfigError,
     "step", "-3"),
    ("cb-state-fractional-step", lambda: callback().load_state_dict(state(step=2.7)), ConfigError,
     "step", "2.7"),
    ("cb-state-zero-ranks", lambda: callback().load_state_dict(state(num_ranks=0)), ConfigError,
     "num_ranks", "0"),
    ("cb-state-batch-str", lambda: callback().load_state_dict(state(global_batch_size="8")),
     ConfigError, "global_batch_size", "'8'"),
    # a scheduled split that is not one of B would silently change the global batch
    ("cb-state-bad-change", lambda: callback().load_state_dict(state(changes=[(5, [3])])),
     ConfigError, "changes", "[3]"),
    ("cb-state-garbage-changes", lambda: callback().load_state_dict(state(changes="xx")),
     ConfigError, "changes", "'xx'"),
    # changes are applied in order: a hand-edited file out of order would apply its
    # splits at other steps than saved
    ("cb-state-unsorted-changes", lambda: callback().load_state_dict(
        state(changes=[(9, [B]), (5, [B])])), ConfigError, "changes", "[9, 5]"),
    ("cb-state-garbage-controller", lambda: callback().load_state_dict(
        state(controller={"sizes": "x", "times": 5})), ConfigError, "history", "'x'"),
    ("cb-state-wrong-width-history", lambda: callback().load_state_dict(
        state(controller={"sizes": [[1, 7]], "times": [[1.0, 1.0]]})), ConfigError,
     "history", "2 ranks"),
    ("sampler-shuffle-str", lambda: sampler(shuffle="no"), ConfigError, "shuffle", "'no'"),
    ("sampler-drop-last-str", lambda: sampler(drop_last="no"), ConfigError, "drop_last", "'no'"),
    ("sampler-state-none", lambda: sampler().load_state_dict(None), ConfigError, "state_dict",
     "NoneType"),
    ("sampler-state-negative-epoch", lambda: sampler().load_state_dict(
        {"epoch": -1, "step_in_epoch": 0}), ConfigError, "epoch", "-1"),
    ("sampler-state-fractional-step", lambda: sampler().load_state_dict(
        {"epoch": 0, "step_in_epoch": 1.5}), ConfigError, "step_in_epoch", "1.5"),
    ("static-zero-size", lambda: StaticSchedule([0, 4]), ConfigError, "batch_sizes", "[0, 4]"),
    ("static-empty", lambda: StaticSchedule([]), ConfigError, "batch_sizes", "[]"),
    ("static-fractional", lambda: StaticSchedule([2.5, 2]), ConfigError, "batch_sizes", "[2.5, 2]"),
    ("static-rank", lambda: StaticSchedule([2, 2], rank=5), ConfigError, "rank", "5"),
    # emulation options, from the environment as a launcher would set them
    ("env-sample-cost", lambda: emulation(OMNIHVD_EMULATE_SAMPLE_COST="fast"), ConfigError,
     "sample_cost", "'fast'"),
    ("env-mode", lambda: emulation(OMNIHVD_EMULATE_MODE="warp"), ConfigError, "mode", "'warp'"),
    ("env-schedule", lambda: emulation(OMNIHVD_EMULATE="1,1;x"), ConfigError, "schedule", "'x'"),
    ("env-cpus", lambda: emulate.cpu_plan_from_args(
        argparse.Namespace(), 0, 2, environ={"OMNIHVD_CPUS": "0,a"}),
     ConfigError, "CPU plan", "'a'"),
    ("schedule-none", lambda: emulate.parse_schedule(None), ConfigError, "schedule", "None"),
    ("schedule-empty-speed", lambda: emulate.parse_schedule("0:1,,1"), ConfigError,
     "speeds", "'0:1,,1'"),
    ("schedule-unknown-level", lambda: emulate.parse_schedule("HL4;100:HL9"), ConfigError,
     "level", "'100:HL9'"),
    ("schedule-period-float", lambda: emulate.parse_schedule("dynamic:2.5"), ConfigError,
     "period", "'dynamic:2.5'"),
    ("level-int", lambda: emulate.level_speeds(5), ConfigError, "level", "5"),
    ("level-ranks", lambda: levels.level_speeds("HL4", ranks=0), ConfigError, "ranks", "0"),
    # the ideal step time of a run log: one time per size
    ("ideal-step-lengths", lambda: telemetry.ideal_step_time([1, 2], [1.0]), ConfigError,
     "times", "2 sizes"),
    # once strict xfails: accepted, or failing with an error other than omnihvd's
    ("model-width-0", lambda: models.build_model("cnn", width=0), ConfigError, "width", "0"),
    ("model-classes-0", lambda: models.build_model("cnn", num_classes=0), ConfigError,
     "num_classes", "0"),
    ("resnet-groups-0", lambda: models.build_model("resnet", groups=0), ConfigError,
     "groups", "0"),
    ("model-unknown-option", lambda: models.build_model("cnn", depth=3), ConfigError,
     "option", "'depth'"),
]


@pytest.mark.parametrize("call,error,option,value", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_value_is_a_value_error_naming_it(call, error, option, value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # `omnihvd simulate` must fail before writing anything
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, ValueError) and isinstance(info.value, OmniHvdError)
    message = str(info.value)
    assert option in message and value in message, message
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv,option,value", [
    (["simulate", "--ranks", "0", "--steps", "5"], "ranks", "0"),
    (["simulate", "--ranks", "2", "--steps", "5", "--gain", "-1"], "gain", "-1.0"),
    (["simulate", "--ranks", "2", "--steps", "5", "--min-batch-size", "4", "--max-batch-size",
      "2"], "min_batch_size 4", "max_batch_size 2"),
])
def test_cli_bad_value_is_a_message_naming_it_and_exit_2(argv, option, value, tmp_path,
                                                         monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # `omnihvd simulate` must fail before writing anything
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("omnihvd simulate: ") and option in err and value in err, err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv,message", [
    # these ran anyway: B=0 as the default 128, --every 0 as 1, --phase-steps 0 as the
    # default, -5 crashed in convergence(), nan/inf slowdowns blamed "model slopes"
    (["-B", "0"], "argument --global-batch-size/-B: expected a positive int, got '0'"),
    (["--every", "0"], "argument --every: expected a positive int, got '0'"),
    (["--phase-steps", "-5"], "argument --phase-steps: expected a positive int, got '-5'"),
    (["--profile", "noisy", "--slowdown", "nan"],
     "argument --slowdown: expected a positive float, got 'nan'"),
])
def test_cli_simulate_refuses_what_it_ran_with_a_default(argv, message, tmp_path, monkeypatch,
                                                         capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        cli.main(["simulate", "--ranks", "2", "--steps", "5"] + argv)
    assert info.value.code == 2 and message in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv,message", [
    # these reported an efficiency of nan
    (["--profile", "drift", "--drift", "nan"], "drift must be within 0..1"),
    (["--profile", "drift", "--drift", "1e300"], "drift must be within 0..1"),
    (["--noise", "1e200"], "noise must be one number within 0..100"),
])
def test_cli_simulate_refuses_values_that_made_its_figures_nan(argv, message, tmp_path,
                                                               monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["simulate", "--ranks", "2", "--steps", "5"] + argv) == 2
    assert message in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_cli_simulate_to_a_folder_it_cannot_create_exits_2(capsys):
    assert cli.main(["simulate", "--ranks", "2", "--steps", "5", "--out", "/proc/x"]) == 2
    assert "cannot create the --out folder /proc/x" in capsys.readouterr().err


def test_cli_doctor_refuses_a_timeout_that_is_not_positive(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["doctor", "--timeout", "0"])
    assert info.value.code == 2
    assert "expected a positive number of seconds, got '0'" in capsys.readouterr().err


def test_cli_plot_of_a_missing_log_says_which_and_exits_2(tmp_path, capsys):
    missing = str(tmp_path / "run.jsonl")
    assert cli.main(["plot", missing]) == 2
    assert missing in capsys.readouterr().err


def test_cli_unknown_choice_names_the_value_and_the_choices(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["simulate", "--policy", "pid"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "'pid'" in err and "affine" in err and "proportional" in err
