"""The phase plan as a pure function of the step (TorchTitan's schedules are tested the same
way: row by row). Megatron-LM's loop decides checkpoints, validation and exits itself."""

from tst_megatron.superposition.schedule import Phase, Schedule, TSTConfig


def test_phase_schedule_is_a_pure_function_of_the_step():
    schedule = Schedule.plan(
        TSTConfig(bag_size=4, phase1_fraction=0.3), seq_length=32, train_iters=10
    )
    phases = [schedule.phase_at(i) for i in range(10)]
    assert schedule.n1 == 3
    assert phases[:3] == [Phase(1, 4, 128, 32, 0)] * 3
    assert phases[3:] == [Phase(2, 1, 32, 32, 3)] * 7
    assert TSTConfig(bag_size=4).phase1_steps(100) == 30  # the paper's r = 0.3 by default
    assert TSTConfig(bag_size=1, phase1_iters=5).phase1_steps(100) == 0  # S = 1 is a baseline
    assert TSTConfig(bag_size=6, phase1_iters=7).phase1_steps(100) == 7
    output = Schedule.plan(TSTConfig(bag_size=4, mode="output"), seq_length=32, train_iters=10)
    assert output.phase_at(0) == Phase(1, 4, 32, 32, 0)  # T-token samples in output mode


def test_baseline_never_switches_and_r_1_switches_at_the_end():
    baseline = Schedule.plan(TSTConfig(bag_size=1), seq_length=8, train_iters=5)
    assert baseline.n1 == 0 and all(baseline.phase_at(i).index == 2 for i in range(5))
    whole = Schedule.plan(TSTConfig(bag_size=2, phase1_iters=5), seq_length=8, train_iters=5)
    assert whole.n1 == 5 and all(whole.phase_at(i).index == 1 for i in range(5))


def test_each_bad_setting_is_one_line_naming_its_flag_and_the_bounds_are_inclusive():
    assert TSTConfig(bag_size=4, phase1_iters=0).validate(10) == []
    assert TSTConfig(bag_size=4, phase1_iters=10).validate(10) == []
    assert TSTConfig(bag_size=4, phase1_fraction=0.0).validate(10) == []
    assert TSTConfig(bag_size=4, phase1_fraction=1.0).validate(10) == []
    assert TSTConfig(bag_size=1, loss_chunks=1).validate(10) == []
    cases = [
        (dict(bag_size=0), "--tst-bag-size must be an integer >= 1, got 0"),
        (dict(bag_size=2.0), "--tst-bag-size must be an integer >= 1, got 2.0"),
        (dict(bag_size=True), "--tst-bag-size must be an integer >= 1, got True"),
        (
            dict(bag_size=4, phase1_iters=3, phase1_fraction=0.3),
            "give --tst-phase1-iters or --tst-phase1-fraction, not both",
        ),
        (
            dict(bag_size=4, phase1_iters=-1),
            "--tst-phase1-iters -1 must be in [0, --train-iters 10]",
        ),
        (
            dict(bag_size=4, phase1_iters=11),
            "--tst-phase1-iters 11 must be in [0, --train-iters 10]",
        ),
        (dict(bag_size=4, phase1_fraction=-0.1), "--tst-phase1-fraction -0.1 must be in [0, 1]"),
        (dict(bag_size=4, phase1_fraction=1.5), "--tst-phase1-fraction 1.5 must be in [0, 1]"),
        (dict(loss_chunks=0), "--tst-loss-chunks must be an integer >= 1, got 0"),
        (dict(loss_chunks=2.0), "--tst-loss-chunks must be an integer >= 1, got 2.0"),
        (dict(loss_chunks=True), "--tst-loss-chunks must be an integer >= 1, got True"),
        (dict(mode="input"), "--tst-mode input needs --tst-bag-size > 1 (S = 1 has no phase 1)"),
    ]
    for fields, line in cases:
        assert TSTConfig(**fields).validate(10) == [line], fields


def test_notes_say_when_there_is_no_phase_1_or_no_phase_2():
    assert TSTConfig().notes(10) == []
    assert TSTConfig(bag_size=4, phase1_iters=3).notes(10) == []
    assert TSTConfig(bag_size=1, phase1_iters=3).notes(10) == [
        "--tst-phase1-iters without --tst-bag-size > 1: no phase 1 (plain run)"
    ]
    assert TSTConfig(bag_size=1, phase1_iters=3, phase1_fraction=0.5).notes(10) == [
        "--tst-phase1-iters and --tst-phase1-fraction without --tst-bag-size > 1: no phase 1 "
        "(plain run)"
    ]
    assert TSTConfig(bag_size=1, phase1_fraction=0.5).notes(10) == [
        "--tst-phase1-fraction without --tst-bag-size > 1: no phase 1 (plain run)"
    ]
    assert TSTConfig(bag_size=4, phase1_iters=10).notes(10) == [
        "phase 1 fills all 10 iterations: this run trains no next-token step (continue it "
        "from its last checkpoint with a larger --train-iters, the same --tst-phase1-iters and "
        "--override-opt-param-scheduler: the learning-rate schedule becomes the longer run's, "
        "from the checkpoint's iteration on)"
    ]
    assert TSTConfig(bag_size=4, phase1_iters=1).notes(1)[0].startswith("phase 1 fills all 1 ")
    (line,) = TSTConfig(bag_size=4, phase1_fraction=1.0).notes(7)
    assert line.startswith("phase 1 fills all 7 iterations")
    assert TSTConfig(bag_size=2, phase1_iters=5).notes(5)[0].startswith("phase 1 fills all 5")
    assert TSTConfig(bag_size=4, phase1_iters=9).notes(10) == []
    assert TSTConfig(bag_size=4, phase1_iters=0).notes(0) == []  # no iterations: nothing to say
