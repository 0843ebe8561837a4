"""The launcher's ``--tst-*`` flags and TST checks on top of Megatron-LM's arguments
(:mod:`tst_megatron.training`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re

import pytest

from tst_megatron.loop import switch
from tst_megatron.loop.plan import consumed_samples, run_plan, train_iters, tst_config
from tst_megatron.superposition.schedule import TSTConfig
from tst_megatron.training import checks
from tst_megatron.training.checks import resume
from tst_megatron.training.flags import add_tst_args


# The functions under test read the run plan (built once per launch); these build it from
# ``args`` as the launch's check does.
def schedule(args):
    return run_plan(args).schedule


def switch_sample(args):
    return run_plan(args).switch_sample


def tst_problems(args):
    return checks.tst.tst_problems(args, run_plan(args))


def switch_overrides(args, n1):
    plan = run_plan(args)
    assert plan.n1 == n1
    return switch.switch_overrides(args, plan)


def switch_validation_samples(args):
    return switch.switch_validation_samples(args, run_plan(args))


def resume_problems(args, saved, iteration):
    return resume.resume_problems(args, run_plan(args), saved, iteration)


def _parse(argv):
    return add_tst_args(argparse.ArgumentParser()).parse_args(argv)


def test_tst_flags_are_the_dataclass_fields():
    parser = add_tst_args(argparse.ArgumentParser())
    flags = sorted(o for a in parser._actions for o in a.option_strings if o.startswith("--"))
    assert flags == [
        "--device",
        "--disable-tst-save-at-switch",
        "--dry-run",
        "--dry-run-gpu",
        "--help",
        "--no-tst-save-at-switch",
        "--trust-checkpoint",
        "--tst-bag-size",
        "--tst-bag-weighting",
        "--tst-loss-chunks",
        "--tst-mode",
        "--tst-phase1-fraction",
        "--tst-phase1-iters",
    ]
    # defaults are the dataclass defaults; every field has a flag
    assert tst_config(_parse([])) == TSTConfig()
    assert {f"tst_{f.name}" for f in dataclasses.fields(TSTConfig)} <= set(vars(_parse([])))
    # a field the args lack (a checkpoint saved before it existed) takes its default
    assert tst_config(argparse.Namespace(tst_bag_size=2)) == TSTConfig(bag_size=2)


def test_the_tst_help_is_written_for_users():
    """No markup, no field names, the real defaults, each ``--no-`` flag describing itself."""
    import dataclasses as dc

    parser = add_tst_args(argparse.ArgumentParser())
    (group,) = [g for g in parser._action_groups if g.title.startswith("token superposition")]
    helps = {a.option_strings[0]: a.help for a in group._group_actions}
    text = parser.format_help()
    assert "`" not in text and "(default: None)" not in text and "%(" not in text
    for field in dc.fields(TSTConfig):
        if "_" in field.name:
            assert field.name not in " ".join(helps.values()), field.name
    assert "0.3" in helps["--tst-phase1-fraction"] and "0.3" in helps["--tst-phase1-iters"]
    assert "Default: 1." in helps["--tst-bag-size"]
    for flag, help_text in helps.items():
        assert help_text and help_text[0].isupper(), flag
        if flag.startswith("--no-"):
            assert help_text.startswith("Do not"), (flag, help_text)
    assert "CPU_FLAGS" not in helps["--device"]


def test_tst_flags_parse_into_the_config():
    args = _parse(
        "--tst-bag-size 4 --tst-phase1-fraction 0.25 --tst-bag-weighting power "
        "--tst-mode input --no-tst-save-at-switch".split()
    )
    assert tst_config(args) == TSTConfig(
        bag_size=4, phase1_fraction=0.25, bag_weighting="power", mode="input", save_at_switch=False
    )
    with pytest.raises(SystemExit):
        _parse(["--tst-mode", "bags"])  # not a choice of the Literal


def _megatron_args(**overrides):
    """The Megatron-LM arguments the TST checks read, with a valid TST run as defaults."""
    values = dict(vars(_parse(["--tst-bag-size", "4"])))
    # 100 iterations of a global batch 8 = micro-batch 2 x DP 2, samples of 32 tokens
    values.update(train_iters=100, train_samples=None, step_batch_size_schedule=None)
    values.update(global_batch_size=8, micro_batch_size=2, data_parallel_size=2, seq_length=32)
    # the data and loop settings the checks read, as a plain run has them
    values.update(dataloader_type="single", reset_position_ids=False, reset_attention_mask=False)
    values.update(train_data_path=None, valid_data_path=None, test_data_path=None)
    values.update(mtp_num_layers=None, overlap_param_gather=False, phase_transition_iterations=None)
    values.update(overrides)
    return argparse.Namespace(**values)


def test_a_valid_tst_run_has_no_problem_and_switches_at_n1_global_batches():
    args = _megatron_args()
    assert tst_problems(args) == []
    assert schedule(args).n1 == 30  # the paper's r = 0.3 of 100 iterations
    assert switch_sample(args) == 30 * 8
    samples = _megatron_args(train_iters=None, train_samples=800)  # 100 iterations of 8
    assert switch_sample(samples) == 30 * 8


def test_the_switch_under_a_step_batch_size_schedule_counts_consumed_samples():
    # Megatron-LM's thresholds are tokens (--seq-length 32 per sample): batch 4 until 640
    # tokens = 20 samples are consumed, then 8. By hand: 5 steps of 4, then steps of 8.
    args = _megatron_args(step_batch_size_schedule="0:4 640:8", tst_phase1_iters=7)
    assert consumed_samples(args, 5) == 20
    assert switch_sample(args) == 5 * 4 + 2 * 8
    # --train-samples 100: 5 steps reach 20, then (100 - 20) / 8 = 10 steps (update_train_iters)
    by_samples = _megatron_args(
        step_batch_size_schedule="0:4 640:8", train_iters=None, train_samples=100
    )
    assert train_iters(by_samples) == 15
    assert schedule(by_samples).n1 == round(0.3 * 15)


@pytest.mark.parametrize(
    "overrides, flag",
    [
        ({"reset_position_ids": True}, "--reset-position-ids"),
        ({"reset_attention_mask": True}, "--reset-attention-mask"),
        ({"phase_transition_iterations": [50]}, "--phase-transition-iterations"),
        ({"dataloader_type": "cyclic"}, "--dataloader-type"),
        ({"tst_phase1_iters": 500}, "--tst-phase1-iters"),
    ],
)
def test_a_setting_tst_cannot_run_is_one_line_naming_the_flag(overrides, flag):
    problems = tst_problems(_megatron_args(**overrides))
    assert len(problems) == 1 and flag in problems[0], problems
    assert "\n" not in problems[0]


def test_multi_token_prediction_is_accepted_with_a_phase1():
    # MTP trains in phase 2 only (TSTGPTModel skips its block in phase 1)
    assert tst_problems(_megatron_args(mtp_num_layers=1)) == []
    assert tst_problems(_megatron_args(mtp_num_layers=2, tst_mode="output")) == []
    assert tst_problems(_megatron_args(overlap_param_gather=True)) == []
    # the skipped MTP block waits for its parameters' all-gather (TSTGPTModel)
    assert tst_problems(_megatron_args(mtp_num_layers=1, overlap_param_gather=True)) == []


def test_phase1_refusals_do_not_apply_without_a_phase1():
    args = _megatron_args(
        tst_bag_size=1,
        reset_position_ids=True,
        rampup_batch_size=["4", "4", "9"],
        mtp_num_layers=1,
        overlap_param_gather=True,
    )
    assert tst_problems(args) == []


def _refusal(done) -> str:
    """The one ``error:`` line of a launch refused before any work: exit status 2, no
    traceback."""
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(errors) == 1, errors
    assert "Traceback" not in done.stderr
    return errors[0]


@pytest.mark.slow
def test_launcher_refuses_before_any_work_with_one_error_line(run_launcher):
    argv = [
        "--device", "cpu", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "10",
        "--lr", "1e-3", "--eval-interval", "5", "--tst-bag-size", "2", "--reset-position-ids",
    ]  # fmt: skip
    done = run_launcher(*argv, timeout=300)
    assert "--reset-position-ids" in _refusal(done)
    # refused before pretrain(): no model, no data
    assert "number of parameters on" not in done.stdout
    assert "> building train, validation, and test datasets" not in done.stdout


def _switch_args(**overrides):
    """A run switching at N1 = 30 of 100 iterations, saving every 40, validating every 25
    (2 iterations of the global batch 8), logging every 20."""
    values = dict(save="/ckpt", save_interval=40, eval_interval=25, log_interval=20, eval_iters=2)
    values.update(do_valid=True, skip_train=False, start_eval_at_iter=None, full_validation=False)
    values.update(overrides)
    return _megatron_args(**values)


def test_switch_overrides_set_only_the_intervals_that_miss_n1():
    n1 = schedule(_switch_args()).n1
    assert n1 == 30
    every = {"save_interval": 30, "eval_interval": 30, "log_interval": 30}
    assert switch_overrides(_switch_args(), n1) == every
    # an interval that already divides N1 is left alone: no second save or validation
    divides = _switch_args(save_interval=10, eval_interval=15, log_interval=1)
    assert switch_overrides(divides, n1) == {}
    # no checkpoint without --save or with --no-tst-save-at-switch; validation stays
    for args in (_switch_args(save=None), _switch_args(tst_save_at_switch=False)):
        assert switch_overrides(args, n1) == {"eval_interval": 30, "log_interval": 30}
    # no validation when it is off or starts later (Megatron-LM's own conditions)
    for off in (
        {"do_valid": False},
        {"eval_iters": 0},
        {"start_eval_at_iter": 31},
    ):
        assert "eval_interval" not in switch_overrides(_switch_args(**off), n1), off
    # --eval-interval / --save-interval unset: the switch still gets its own
    unset = _switch_args(eval_interval=None, save_interval=None)
    assert switch_overrides(unset, n1) == every
    # no switch inside the run: nothing
    assert switch_overrides(_switch_args(skip_train=True), n1) == {}
    assert switch_overrides(_switch_args(tst_phase1_iters=100), 100) == {}
    assert switch_overrides(_switch_args(tst_bag_size=1), 0) == {}


def test_the_validation_set_is_sized_for_the_round_at_the_switch():
    # Megatron-LM sizes (100 // 25 + 1) rounds of 2 iterations of 8; the switch adds one
    assert switch_validation_samples(_switch_args()) == 2 * 8
    assert switch_validation_samples(_switch_args(eval_interval=15)) == 0
    assert switch_validation_samples(_switch_args(eval_iters=0)) == 0
    assert switch_validation_samples(_switch_args(full_validation=True)) == 0
    assert switch_validation_samples(_switch_args(skip_train=True)) == 0
    assert switch_validation_samples(_switch_args(eval_global_batch_size=4)) == 8


def _without(name, **overrides):
    """:func:`_switch_args` without the attribute ``name`` (a Megatron-LM that lacks it)."""
    args = _switch_args(**overrides)
    delattr(args, name)
    return args


def test_the_switch_reads_megatron_lms_validation_conditions_at_their_edges():
    every = {"save_interval": 30, "eval_interval": 30, "log_interval": 30}
    # validation at N1 when --eval-iters is 1, or validation starts exactly at N1
    assert switch_overrides(_switch_args(eval_iters=1), 30) == every
    assert switch_overrides(_switch_args(start_eval_at_iter=30), 30) == every
    assert switch_validation_samples(_switch_args(start_eval_at_iter=30)) == 2 * 8
    assert switch_validation_samples(_switch_args(start_eval_at_iter=31)) == 0
    # a list of --eval-iters (one per validation set) counts their sum
    assert switch_validation_samples(_switch_args(eval_iters=[1, 2])) == 3 * 8
    # the switch at the first or last possible step, or none at N1 = 0
    assert switch_overrides(_switch_args(tst_phase1_iters=1), 1) == {
        "save_interval": 1, "eval_interval": 1, "log_interval": 1,
    }  # fmt: skip
    assert switch_overrides(_switch_args(tst_phase1_iters=99), 99) == {
        "save_interval": 99, "eval_interval": 99, "log_interval": 99,
    }  # fmt: skip
    assert switch_overrides(_switch_args(tst_phase1_iters=0), 0) == {}
    assert switch_validation_samples(_switch_args(tst_phase1_iters=0)) == 0


def test_the_switch_takes_megatron_lms_defaults_for_attributes_it_lacks():
    every = {"save_interval": 30, "eval_interval": 30, "log_interval": 30}
    no_eval = {"save_interval": 30, "log_interval": 30}
    assert switch_overrides(_without("skip_train"), 30) == every
    assert switch_overrides(_without("start_eval_at_iter"), 30) == every
    assert switch_overrides(_without("eval_iters"), 30) == no_eval
    assert switch_overrides(_without("do_valid"), 30) == no_eval
    assert switch_validation_samples(_without("full_validation")) == 2 * 8
    assert switch_validation_samples(_without("eval_iters")) == 0


def test_the_switch_intervals_hold_for_iteration_n1_only(capsys):
    """Driven as the forward step drives it (every micro-batch of every iteration): the
    intervals are N1's from the last phase-1 step until the first phase-2 step, then the
    user's again."""
    from tst_megatron.loop.switch import SwitchIntervals

    args = _switch_args(rank=0)
    plan, machine = run_plan(args), SwitchIntervals()
    user = {"save_interval": 40, "eval_interval": 25, "log_interval": 20}
    seen = {}
    for iteration in [0, 1, 28, 28, 29, 29, 30, 30, 31, 29]:
        args.curr_iteration = iteration
        machine.at_step(args, plan)
        seen[iteration] = {k: getattr(args, k) for k in user}
    assert seen[0] == seen[28] == seen[30] == seen[31] == user
    # 29 again after 31 (a later, stale call) changes nothing: the switch is done
    assert seen[29] == user
    args.curr_iteration = 29
    machine = SwitchIntervals()
    machine.at_step(args, plan)
    machine.at_step(args, plan)  # a second micro-batch keeps the user's values to restore
    assert {k: getattr(args, k) for k in user} == dict.fromkeys(user, 30)
    out = capsys.readouterr().out
    assert out.count("TST: at the switch (iteration 30): checkpoint, validation, log line ") == 2
    assert "(--save-interval, --eval-interval, --log-interval 30 for this iteration only)" in out


def test_the_switch_intervals_after_a_restart_or_a_resume(capsys):
    """An in-process restart to before the last phase-1 step (after the intervals were set)
    puts the user's values back and sets them again at N1 - 1; a run resumed after the switch
    changes nothing."""
    from tst_megatron.loop.switch import SwitchIntervals

    user = {"save_interval": 40, "eval_interval": 25, "log_interval": 20}
    args = _switch_args(rank=0)
    plan, machine = run_plan(args), SwitchIntervals()
    for iteration, want in ((29, 30), (28, None), (27, None), (29, 30), (30, None)):
        args.curr_iteration = iteration
        machine.at_step(args, plan)
        got = {k: getattr(args, k) for k in user}
        assert got == (user if want is None else dict.fromkeys(user, want)), iteration
    assert capsys.readouterr().out.count("TST: at the switch (iteration 30)") == 2
    resumed = _switch_args(rank=0, curr_iteration=35)
    SwitchIntervals().at_step(resumed, plan)
    assert {k: getattr(resumed, k) for k in user} == user and capsys.readouterr().out == ""


def test_the_switch_intervals_are_printed_on_rank_0_only(capsys):
    from tst_megatron.loop.switch import SwitchIntervals

    args = _switch_args(rank=1, curr_iteration=29)
    SwitchIntervals().at_step(args, run_plan(args))
    assert args.save_interval == 30 and capsys.readouterr().out == ""
    args = _switch_args(
        rank=0, curr_iteration=29, save_interval=10, eval_interval=15, log_interval=1
    )
    SwitchIntervals().at_step(args, run_plan(args))
    assert capsys.readouterr().out == ""  # nothing changed: nothing to say


def test_no_tst_save_at_switch_is_accepted():
    assert tst_problems(_switch_args(tst_save_at_switch=False)) == []


def test_help_lists_megatron_lms_flags_and_ours(run_launcher):
    """``--help`` works (Megatron-LM 0.19.2's own fails on a ``%`` in one help text) and lists
    Megatron-LM's flags with ours."""
    done = run_launcher("--help")
    assert done.returncode == 0, done.stderr[-2000:]
    for flag in ("--tst-bag-size", "--num-layers", "--step-batch-size-schedule", "--dry-run"):
        assert flag in done.stdout
    assert "(e.g. 1.10 = 10%)" in " ".join(done.stdout.split())


def _resume_args(**tst):
    """Megatron-LM arguments of a 100-iteration run, S = 4, N1 = 30."""
    values = dict(
        vars(_parse(["--tst-bag-size", "4", "--tst-phase1-iters", "30"])),
        train_iters=100,
        train_samples=None,
        global_batch_size=8,
        seq_length=32,
    )
    values.update({f"tst_{k}": v for k, v in tst.items()})
    return argparse.Namespace(**values)


def test_a_resume_that_would_change_the_tst_run_is_refused():
    saved = _resume_args()
    # before the switch: another N1, bag size, mode or weighting changes the phase-1 data/loss
    (line,) = resume_problems(_resume_args(bag_size=2), saved, 10)
    assert "--tst-bag-size 4" in line and "--tst-bag-size 2" in line and "iteration 10" in line
    (line,) = resume_problems(_resume_args(mode="output"), saved, 10)
    assert "--tst-mode full" in line
    (line,) = resume_problems(_resume_args(bag_weighting="power"), saved, 10)
    assert "--tst-bag-weighting uniform" in line
    (line,) = resume_problems(_resume_args(phase1_iters=40), saved, 10)
    assert "N1 = 30" in line and "N1 = 40" in line
    # after the switch, phase 2's order still depends on the windows phase 1 read: N1 (also
    # through --train-iters), the bag size and the global batch
    (line,) = resume_problems(_resume_args(phase1_iters=40), saved, 35)
    assert "N1 = 30" in line
    (line,) = resume_problems(_resume_args(phase1_iters=20), saved, 50)
    assert "N1 = 30" in line and "N1 = 20" in line
    (line,) = resume_problems(_resume_args(bag_size=2), saved, 50)
    assert "--tst-bag-size 4" in line
    (line,) = resume_problems(_resume_args(mode="output"), saved, 50)  # 1 window per sample
    assert "--tst-mode full" in line
    train_iters_changed = argparse.Namespace(**{**vars(_resume_args()), "train_iters": 200})
    train_iters_changed.tst_phase1_iters, saved_fraction = None, _resume_args(phase1_iters=None)
    saved_fraction.tst_phase1_fraction = train_iters_changed.tst_phase1_fraction = 0.3
    (line,) = resume_problems(train_iters_changed, saved_fraction, 50)
    assert "N1 = 30" in line and "N1 = 60" in line
    (line,) = resume_problems(
        argparse.Namespace(**{**vars(saved), "global_batch_size": 16}), saved, 50
    )
    assert "--global-batch-size" in line
    # what phase 2 does not read may change after the switch: the loss's weighting, and the
    # mode between the two that read S windows per sample
    assert resume_problems(_resume_args(bag_weighting="power"), saved, 50) == []
    assert resume_problems(_resume_args(mode="input"), saved, 50) == []
    assert resume_problems(_resume_args(), saved, 10) == []
    assert resume_problems(_resume_args(bag_size=2), saved, 0) == []  # not resumed
    # a checkpoint of Megatron-LM's own pretrain_gpt.py has no --tst-* arguments
    plain = argparse.Namespace(**{k: v for k, v in vars(saved).items() if not k.startswith("tst_")})
    assert resume_problems(_resume_args(bag_size=2), plain, 10) == []


def test_a_resume_with_another_model_is_refused_unless_the_checkpoint_args_are_used():
    from tst_megatron.training.checks.architecture import architecture_problems

    saved = argparse.Namespace(
        num_layers=2, hidden_size=32, ffn_hidden_size=128, num_experts=None, swiglu=False,
        group_query_attention=False, num_query_groups=1, load="/ckpt",
    )  # fmt: skip
    assert architecture_problems(argparse.Namespace(**vars(saved)), saved) == []
    args = argparse.Namespace(**{**vars(saved), "hidden_size": 64, "ffn_hidden_size": 256})
    (line,) = architecture_problems(args, saved)
    assert line == (
        "the checkpoint in --load /ckpt is of another model: --hidden-size 32 (this run: 64), "
        "--ffn-hidden-size 128 (this run: 256); give the checkpoint's model flags (or "
        "--use-checkpoint-args)"
    )
    for name, value in (("num_experts", 4), ("swiglu", True)):
        args = argparse.Namespace(**{**vars(saved), name: value})
        (line,) = architecture_problems(args, saved)
        assert f"--{name.replace('_', '-')} {getattr(saved, name)} (this run: {value})" in line
        args.use_checkpoint_args = True  # Megatron-LM then takes the checkpoint's
        assert architecture_problems(args, saved) == []
    # query groups only count with --group-query-attention
    args = argparse.Namespace(**{**vars(saved), "num_query_groups": 2})
    assert architecture_problems(args, saved) == []


#: A tiny TST launch on mock data (S = 2, N1 = 3 of 6) saving torch_dist checkpoints: the
#: real-launch resume tests add their --save/--load and intervals.
_TINY_RESUME = [
    "--device", "cpu", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "128", "--num-layers", "1", "--hidden-size", "32",
    "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "6",
    "--lr", "1e-3", "--eval-interval", "6", "--eval-iters", "1", "--num-workers", "0",
    "--tst-bag-size", "2", "--tst-phase1-iters", "3", "--ckpt-format", "torch_dist",
]  # fmt: skip


@pytest.mark.slow
def test_a_resume_with_another_bag_size_or_train_iters_stops_with_one_line(run_launcher, tmp_path):
    """The launcher reads the checkpoint's recorded ``args`` and learning-rate schedule and
    refuses before any work (Megatron-LM's own resume checks know no ``--tst-*`` flag; its
    scheduler's assertion comes after the model is built)."""
    save = str(tmp_path / "ckpt")
    argv = _TINY_RESUME + [
        "--no-tst-save-at-switch", "--save", save, "--load", save,
        "--save-interval", "1", "--exit-interval", "1",
    ]  # fmt: skip
    first = run_launcher(*argv)
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_launcher(*megatron_lm_with(argv, "--tst-bag-size", "4"))
    assert "--tst-bag-size 2" in _refusal(again)
    # another --train-iters: Megatron-LM's scheduler would assert after building the model
    longer = run_launcher(*megatron_lm_with(argv, "--train-iters", "8"))
    error = _refusal(longer)
    assert "--override-opt-param-scheduler" in error
    assert "lr_decay_steps 12 -> 16" in error  # iterations x global batch 2
    assert "building GPT model" not in longer.stdout
    # another model: Megatron-LM's check_checkpoint_args asserts while loading
    wider = run_launcher(*megatron_lm_with(argv, "--hidden-size", "64"))
    assert "is of another model: --hidden-size 32 (this run: 64)" in _refusal(wider)
    # run to the end, then again: nothing left to train is a note and status 0
    i = argv.index("--exit-interval")
    to_end = argv[:i] + argv[i + 2 :]  # resumes at 1 and trains to 6, saving every iteration
    done = run_launcher(*to_end)
    assert done.returncode == 0, done.stderr[-3000:]
    again = run_launcher(*to_end)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing left to train" in again.stdout and "Traceback" not in again.stderr
    # the same settings resume: test_megatron_lm_layouts.py (and resume_problems above)


@pytest.mark.slow
@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_the_resume_rules_read_every_checkpoint_format(run_launcher, tmp_path, ckpt_format):
    """The legacy ``torch`` format (``mp_rank_*/model_optim_rng.pt``) gets the same one-line
    refusals as ``torch_dist``: another bag size (which would count phase 1 with the new bag)
    and another ``--seq-length`` (a ``size mismatch`` traceback after the model was built)."""
    save = str(tmp_path / "ckpt")
    argv = megatron_lm_with(_TINY_RESUME, "--ckpt-format", ckpt_format) + [
        "--no-tst-save-at-switch", "--save", save, "--load", save,
        "--save-interval", "1", "--exit-interval", "1",
    ]  # fmt: skip
    first = run_launcher(*argv)
    assert first.returncode == 0, first.stderr[-3000:]
    shards = "mp_rank_00/model_optim_rng.pt" if ckpt_format == "torch" else "metadata.json"
    assert os.path.isfile(os.path.join(save, "iter_0000001", shards))
    for flag, value, words in (
        ("--tst-bag-size", "4", "--tst-bag-size 2"),
        ("--seq-length", "8", "--seq-length"),
    ):
        again = run_launcher(*megatron_lm_with(argv, flag, value))
        assert words in _refusal(again)
        assert "building GPT model" not in again.stdout


@pytest.mark.slow
def test_another_global_batch_after_the_switch_keeps_the_checkpoint_s_switch_sample(
    run_launcher, tmp_path
):
    """``--global-batch-size`` 2 -> 4 on a resume at iteration 4 (after the switch at 3):
    the steps taken keep their batch, so phase 1 still ends at sample 6 and phase 2 reads on
    from phase-2 sample 2 (planned from the new batch alone, the switch would sit at sample
    12, and samples 8-11 would be read as phase-1 samples); before the switch it is refused."""
    save = str(tmp_path / "ckpt")
    argv = _TINY_RESUME + [
        "--no-tst-save-at-switch", "--save", save, "--load", save, "--save-interval", "1",
        "--log-interval", "1", "--override-opt-param-scheduler",  # the schedule is in samples: it changes with the batch
    ]  # fmt: skip
    early = run_launcher(*argv, "--exit-interval", "2")
    assert early.returncode == 0, early.stderr[-3000:]
    refused = run_launcher(*megatron_lm_with(argv, "--global-batch-size", "4"))
    assert "switched at sample 6; this run would switch at sample 12" in _refusal(refused)
    first = run_launcher(*argv, "--exit-interval", "4")
    assert first.returncode == 0, first.stderr[-3000:]
    dry = run_launcher(*megatron_lm_with(argv, "--global-batch-size", "4"), "--dry-run")
    assert dry.returncode == 0 and "switch at sample 6;" in dry.stdout, dry.stdout + dry.stderr
    resumed = run_launcher(*megatron_lm_with(argv, "--global-batch-size", "4"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    raw = {
        int(i): int(r)
        for i, r in re.findall(r"TST: iteration\s+(\d+) \| raw tokens per sample: \d+ \| "
                               r"raw tokens: (\d+)", resumed.stdout)
    }  # fmt: skip
    # 6 phase-1 samples of S*T = 32 tokens, then 2 + 4 + 4 phase-2 windows of 16
    assert raw[5] == 6 * 32 + (12 - 6) * 16 and raw[6] == 6 * 32 + (16 - 6) * 16, raw
    # a second resume reads the batches of both runs from the checkpoint's args
    again = run_launcher(*megatron_lm_with(argv, "--global-batch-size", "4"), "--dry-run")
    assert again.returncode == 0, again.stderr[-3000:]


def test_a_checkpoint_folder_in_no_known_format_is_one_line(tmp_path):
    from tst_megatron.data.resume import read_resume

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3\n")
    (tmp_path / "iter_0000003").mkdir()
    (tmp_path / "iter_0000003" / "weights.bin").write_text("?")
    args = argparse.Namespace(load=str(tmp_path), finetune=False, ckpt_step=None)
    found, line = read_resume(args)  # the launch's one line (the resume rules print it)
    assert found is None
    assert "iter_0000003 (the tracker file's checkpoint) is damaged" in line, line
    assert "no checkpoint Megatron-LM reads is in it" in line, line


def test_any_error_reading_the_checkpoint_to_resume_is_one_line(monkeypatch):
    from tst_megatron.data import resume

    def broken(args):
        raise RuntimeError("unexpected\n  layout")

    monkeypatch.setattr(resume, "checkpoint_to_resume", broken)
    found, line = resume.read_resume(argparse.Namespace(load="/ck"))
    assert found is None
    assert line == (
        "--load /ck: the checkpoint to resume could not be read (RuntimeError: unexpected layout)"
    )


def test_a_torch_dcp_checkpoint_s_common_state_is_read(tmp_path):
    """``torch_dcp``/``fsdp_dtensor`` folders (``.metadata``): only the common keys are read,
    from a checkpoint torch's ``dcp.save`` writes as Megatron-LM's save does (one process)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tst_megatron.data.checkpoint import read_common_state

    saved = argparse.Namespace(tst_bag_size=4, seq_length=16)
    state = {"args": saved, "iteration": 7, "model": {"w": torch.ones(3)}, "rng_state": [1]}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    common = read_common_state(str(tmp_path))
    assert sorted(common) == ["args", "format", "iteration"] and common["iteration"] == 7
    assert common["format"] == "torch_dcp"
    assert common["args"] == saved


def test_layout_changes_megatron_core_cannot_resume_are_one_line():
    """EP=2 -> EP=1 with the optimizer state (megatron-core raises after the model is built;
    ``tests/distributed/test_megatron_lm_loop.py`` runs it) and any model-parallel change of a
    legacy ``torch`` checkpoint; what loads stays free."""
    from tst_megatron.training.checks.architecture import layout_problems

    def ns(**kw):
        base = dict(load="ck", num_experts=4, tensor_model_parallel_size=1,
                    pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                    expert_model_parallel_size=1, expert_tensor_parallel_size=None,
                    no_load_optim=False, finetune=False)  # fmt: skip
        return argparse.Namespace(**{**base, **kw})

    ep2, ep1 = ns(expert_model_parallel_size=2), ns()
    (line,) = layout_problems(ep1, ep2, "torch_dist")
    assert "--no-load-optim" in line and "--expert-model-parallel-size 2" in line, line
    assert layout_problems(ns(no_load_optim=True), ep2, "torch_dist") == []
    assert layout_problems(ns(finetune=True), ep2, "torch_dist") == []
    (line,) = layout_problems(ep2, ep1, "torch_dist")  # 1 -> 2: test_megatron_lm_layouts.py
    assert "does not keep" in line and "--no-load-optim" in line, line
    assert layout_problems(ns(expert_model_parallel_size=4), ep2, "torch_dist") == []
    assert (
        layout_problems(ep1, ns(num_experts=None, expert_model_parallel_size=2), "torch_dist") == []
    )
    # expert TP other than TP keeps expert groups too
    assert layout_problems(ep1, ns(tensor_model_parallel_size=2, expert_tensor_parallel_size=1,
                                   ), "torch_dist") != []  # fmt: skip
    # the legacy format: any model-parallel change, named; DP is free
    (line,) = layout_problems(ns(tensor_model_parallel_size=2), ep1, "torch")
    assert (
        "legacy --ckpt-format torch" in line
        and "--tensor-model-parallel-size 1 (this run: 2)" in line
    )
    assert layout_problems(ns(data_parallel_size=4), ns(data_parallel_size=2), "torch") == []
    assert len(layout_problems(ep1, ep2, "torch")) == 2


def megatron_lm_with(argv, flag, value):
    argv = list(argv)
    argv[argv.index(flag) + 1] = value
    return argv


def test_a_tracker_file_without_an_iteration_is_one_line(tmp_path):
    """Megatron-LM's own reader prints a line and exits with status 0 on it (0.19.2)."""
    from tst_megatron.data.resume import read_resume

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("garbage\n")
    args = argparse.Namespace(load=str(tmp_path), finetune=False, ckpt_step=None)
    found, line = read_resume(args)  # the launch's one line (the resume rules print it)
    assert found is None
    assert "latest_checkpointed_iteration.txt holds 'garbage', not an iteration" in line
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    # a release tracker without its folder: Megatron-LM's load would fail after set-up
    found, line = read_resume(args)
    assert found is None
    assert "release (the tracker file's checkpoint) does not exist" in line, line
    from tests.unit.test_checkpoint_input import write_torch_dist

    write_torch_dist(tmp_path / "release")
    assert read_resume(args) == (None, None)  # a release checkpoint: nothing to resume


def test_the_help_of_each_refused_megatron_lm_flag_says_so():
    """``--help`` marks each Megatron-LM flag the launcher refuses, with why; others not."""
    from megatron.training.arguments import add_megatron_arguments

    parser = add_tst_args(add_megatron_arguments(argparse.ArgumentParser()))
    helps = {a.option_strings[0]: a.help or "" for a in parser._actions if a.option_strings}
    for flag in ("--sft", "--fim-data", "--inprocess-restart", "--train-data-path"):
        assert "Refused by this launcher: " in helps[flag], flag
    assert "Refused by this launcher: TST trains on megatron-core's GPTDataset" in helps["--sft"]
    marked = [flag for flag, text in helps.items() if "Refused by this launcher" in text]
    assert "--lr" not in marked and "--tst-bag-size" not in marked
    assert len(marked) == 14, marked  # 12 data flags, 2 pretrain_gpt.py features
    assert "Refused by this launcher" in parser.format_help()


def test_a_resume_that_would_draw_phase_1_s_blocks_again_is_refused_and_new_data_noted():
    """What the sample orders depend on (``checks.resume.ORDER_FLAGS_*``): another seed,
    sequence length or tokenizer draws other phase-1 blocks, so phase 2 would read text phase
    1 trained on: refused before and after the switch (N1 = 30), naming both values. Other
    data is noted (a curriculum may mean it). Unchanged: nothing."""
    saved = dict(vars(_resume_args()), seed=1234, data_path=["a"], split="99,1,0", vocab_size=128)
    saved.update(tokenizer_type="GPT2BPETokenizer", mock_data=False, data_args_path=None)
    saved = argparse.Namespace(**saved)
    plan = run_plan(saved)
    for at in (10, 30, 50):
        assert resume.resume_problems(saved, plan, saved, at) == []
        assert resume.order_notes(saved, plan, saved, at) == []
        for name, value, flag in (
            ("seed", 99, "--seed 1234"),
            ("seq_length", 64, "--seq-length 32"),
            ("vocab_size", 512, "--vocab-size"),
            ("tokenizer_type", "HuggingFaceTokenizer", "--tokenizer-type GPT2BPETokenizer"),
        ):
            args = argparse.Namespace(**{**vars(saved), name: value})
            (line,) = resume.resume_problems(args, run_plan(args), saved, at)
            assert f"iteration {at}" in line and f"resume with {flag}" in line, line
            assert f"this run has {flag.split()[0]} {value}" in line, line
        for name, value in (
            ("data_path", ["b"]),
            ("split", "98,2,0"),
            ("mock_data", True),
            ("data_args_path", "paths.txt"),
        ):
            args = argparse.Namespace(**{**vars(saved), name: value})
            assert resume.resume_problems(args, run_plan(args), saved, at) == []
            (note,) = resume.order_notes(args, run_plan(args), saved, at)
            assert f"--{name.replace('_', '-')}" in note and "other data" in note, note
    # a blend draws from each dataset in proportion to the run's length: another length redraws
    # phase 1's blocks (refused); one dataset, or the same length, is fine
    blend = argparse.Namespace(**{**vars(saved), "data_path": ["0.5", "a", "0.5", "b"]})
    blend.data_args_path, blend.mock_data = None, False
    for at in (10, 50):
        longer = argparse.Namespace(**{**vars(blend), "train_iters": 200})
        (line,) = resume.resume_problems(longer, run_plan(longer), blend, at)
        assert "blend of datasets" in line and "800 samples" in line and "1,600" in line, line
        assert resume.resume_problems(blend, run_plan(blend), blend, at) == []
        one = argparse.Namespace(**{**vars(longer), "data_path": ["a"]})
        saved_one = argparse.Namespace(**{**vars(blend), "data_path": ["a"]})
        assert resume.resume_problems(one, run_plan(one), saved_one, at) == []
    # not resumed, or a plain (non-TST) checkpoint: nothing
    other = argparse.Namespace(**{**vars(saved), "seed": 99})
    assert resume.resume_problems(other, run_plan(other), saved, 0) == []
    plain = argparse.Namespace(**{k: v for k, v in vars(saved).items() if not k.startswith("tst_")})
    assert resume.resume_problems(other, run_plan(other), plain, 50) == []


def test_another_seed_after_the_switch_is_refused_and_phase_1_only_advice_runs(
    run_launcher, tmp_path
):
    """Random-token data (mock data), S = 2, N1 = 3: a checkpoint after the switch (4) resumed
    with another --seed stops before any work in one line. A run whose phase 1 fills all its
    iterations notes how to continue it; following the note to the letter trains phase 2."""
    save = str(tmp_path / "ckpt")
    argv = _TINY_RESUME + [
        "--seed", "1234", "--save", save, "--load", save,
        "--save-interval", "4", "--exit-interval", "4",
    ]  # fmt: skip
    first = run_launcher(*argv)
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_launcher(*megatron_lm_with(argv, "--seed", "99"))
    error = _refusal(again)
    assert "--seed 1234" in error and "--seed 99" in error
    assert "building GPT model" not in again.stdout

    short = str(tmp_path / "short")
    only1 = megatron_lm_with(megatron_lm_with(argv, "--save", short), "--load", short)
    only1 = megatron_lm_with(megatron_lm_with(only1, "--train-iters", "3"), "--save-interval", "3")
    only1 = megatron_lm_with(only1, "--exit-interval", "3")
    done = run_launcher(*only1)
    assert done.returncode == 0, done.stderr[-3000:]
    (note,) = [line for line in done.stdout.splitlines() if "phase 1 fills all 3" in line]
    assert "--override-opt-param-scheduler" in note and "larger --train-iters" in note
    longer = megatron_lm_with(only1, "--train-iters", "6") + ["--override-opt-param-scheduler"]
    cont = run_launcher(*megatron_lm_with(longer, "--exit-interval", "6"))
    assert cont.returncode == 0, cont.stderr[-3000:]
    assert "TST: phase 2 (next-token) from iteration 3 (switch at 3)" in cont.stdout
    # the launcher's raw-token line: iteration 6 read T = 16 tokens a sample, phase 2's
    assert re.search(r"TST: iteration\s+6 \| raw tokens per sample: 16 \|", cont.stdout)


def test_every_input_of_the_sample_orders_has_a_resume_rule():
    """``checks.resume.ORDER_INPUTS`` holds every key of the orders' cache description: the
    stream's own (``stream.describe``) and megatron-core's dataset description
    (``MegatronDataset._key_config_attributes()`` and the ``unique_identifiers`` keys
    ``GPTDataset.__init__`` sets, read from its source, so that a megatron-core release that
    adds one fails here); each names what a resume may do with it."""
    import inspect

    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.core.datasets.megatron_dataset import MegatronDataset

    from tst_megatron.data.stream import describe

    class Part:
        unique_description_hash = "h"

    stream_keys = set(describe([(Part(), 1)], windows_per_sample=2, phase1_samples=4, seed=1))
    source = inspect.getsource(GPTDataset.__init__) + inspect.getsource(MegatronDataset.__init__)
    set_keys = set(re.findall(r"unique_identifiers\[\"(\w+)\"\]", source))
    assert {"class", "dataset_path", "num_samples", "index_split"} <= set_keys
    dataset_keys = set(MegatronDataset._key_config_attributes()) | set_keys
    dataset_keys |= set(GPTDataset._key_config_attributes())
    assert stream_keys | dataset_keys == set(resume.ORDER_INPUTS)
    kinds = {kind for kind, _ in resume.ORDER_INPUTS.values()}
    assert kinds == {"refused", "noted", "plan", "fixed"}
    for key, (kind, flags) in resume.ORDER_INPUTS.items():
        assert bool(flags) == (kind in ("refused", "noted")), key
    assert resume.ORDER_FLAGS_REFUSED == ("seed", "seq_length", "tokenizer_type", "vocab_size")
    assert set(resume.ORDER_FLAGS_NOTED) == {"split", "data_path", "data_args_path", "mock_data"}


def test_a_resume_on_one_dataset_that_changes_its_epoch_layout_is_refused(tmp_path):
    """One dataset: another run length is fine while megatron-core's GPTDataset index keeps its
    epoch layout (the same windows in the same order: checked on the built datasets), and
    refused in one line when the windows span another number of epochs (the documents are
    shuffled again). The saved run: 100 iterations of 8, S = 4, N1 = 30: 240 * 4 + 560 + 4 =
    1524 windows of 32 tokens, inside one epoch of the 50,000-token split."""
    from tests.unit.test_data_boundary import null_tokenizer, write_dataset
    from tst_megatron.data import gpt_datasets
    from tst_megatron.data.gpt_datasets import DataSettings, build_datasets

    prefix = write_dataset(tmp_path / "docs", [list(range(i, i + 100)) for i in range(500)])
    saved = argparse.Namespace(
        **{**vars(_resume_args()), "data_path": [prefix], "split": "100,0,0"}
    )
    saved.mock_data, saved.data_args_path = False, None
    assert gpt_datasets.train_split_tokens(prefix, "100,0,0") == 50_000
    assert gpt_datasets.train_split_tokens(prefix, "90,10,0") == 45_000

    def windows(iters):  # what the datasets provider asks of the split
        return 240 * 4 + (iters * 8 - 240) + 4

    def built(n):  # megatron-core's own index, the first 1524 windows' first tokens
        data = DataSettings(data_path=prefix, split="100,0,0", data_cache_path=str(tmp_path))
        train, _, _ = build_datasets(data, null_tokenizer(1 << 16), seq_length=32,
                                     samples=(n, 0, 0), seed=1234)  # fmt: skip
        return [int(train[i]["tokens"][0]) for i in range(windows(100))]

    reference = built(windows(100))
    for iters, same in ((102, True), (105, False), (120, False)):
        args = argparse.Namespace(**{**vars(saved), "train_iters": iters})
        found = resume.epoch_problems(args, run_plan(args), saved, 50)
        assert (found == []) == same, (iters, found)
        assert (built(windows(iters)) == reference) == same, iters
        if not same:
            (line,) = found
            assert "over 1 epoch(s)" in line and "over 2 epoch(s)" in line, line
            assert f"{iters * 8:,}" in line and "800 samples" in line, line
    # not resumed, the same length, or a blend (resume_problems' rule): nothing here
    longer = argparse.Namespace(**{**vars(saved), "train_iters": 120})
    assert resume.epoch_problems(longer, run_plan(longer), saved, 0) == []
    assert resume.epoch_problems(saved, run_plan(saved), saved, 50) == []
    blend = argparse.Namespace(**{**vars(longer), "data_path": ["0.5", prefix, "0.5", prefix]})
    assert resume.epoch_problems(blend, run_plan(blend), saved, 50) == []
    # a weighted single dataset is a megatron-core BlendedDataset sized by the run's length:
    # any other length is the blend rule's refusal (found by a review: both rules accepted it)
    weighted = argparse.Namespace(**{**vars(saved), "data_path": ["1.0", prefix]})
    weighted_longer = argparse.Namespace(**{**vars(weighted), "train_iters": 102})
    (line,) = resume.resume_problems(weighted_longer, run_plan(weighted_longer), weighted, 50)
    assert "blend of datasets" in line, line
    # the dataset named through --data-args-path is checked too
    listed = tmp_path / "paths.txt"
    listed.write_text(prefix)
    via_file = argparse.Namespace(**{**vars(saved), "data_path": None,
                                     "data_args_path": str(listed)})  # fmt: skip
    via_file_longer = argparse.Namespace(**{**vars(via_file), "train_iters": 120})
    (line,) = resume.epoch_problems(via_file_longer, run_plan(via_file_longer), via_file, 50)
    assert "over 2 epoch(s)" in line, line
