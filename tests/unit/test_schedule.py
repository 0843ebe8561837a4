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
    # phase-local data steps: phase 2 starts its own data at 0
    assert [p.data_step(i) for i, p in enumerate(phases)] == [0, 1, 2, 0, 1, 2, 3, 4, 5, 6]
    assert [i for i in range(11) if schedule.switches_after(i)] == [3]
    assert TSTConfig(bag_size=4).phase1_steps(100) == 30  # the paper's r = 0.3 by default
    assert TSTConfig(bag_size=1, phase1_iters=5).phase1_steps(100) == 0  # S = 1 is a baseline
    assert TSTConfig(bag_size=6, phase1_iters=7).phase1_steps(100) == 7


def test_baseline_never_switches_and_bound_phases_carry_reader_and_step():
    baseline = Schedule.plan(TSTConfig(bag_size=1), seq_length=8, train_iters=5)
    assert baseline.n1 == 0 and all(baseline.phase_at(i).index == 2 for i in range(5))
    assert not any(baseline.switches_after(i) for i in range(6))
    whole = Schedule.plan(TSTConfig(bag_size=2, phase1_iters=5), seq_length=8, train_iters=5)
    assert [i for i in range(6) if whole.switches_after(i)] == [5]  # r = 1: switch at the end
    bound = whole.bind(phase1=("read1", "step1"), phase2=("read2", "step2"))
    assert (bound.phase_at(0).read_sample, bound.phase_at(0).forward_step) == ("read1", "step1")
    assert bound.phase2.read_sample == "read2" and bound.phase1 == whole.phase1
