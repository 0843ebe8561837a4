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
