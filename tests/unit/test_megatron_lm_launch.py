"""The launcher's glue around Megatron-LM: under ``srun`` without torchrun, Slurm's task
variables reach Megatron-LM under torchrun's names (``export_torchrun_env``); settings that
Megatron-LM refuses only after building the model are refused up front
(``late_megatron_problems``)."""

from __future__ import annotations

import pytest

from tst_megatron.errors import ConfigError
from tst_megatron.runtime.distributed import export_torchrun_env, one_process_env

#: Task 5 of an 8-task step on two nodes (4 per node): what srun sets.
SRUN_TASK = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NODELIST": "gpu-a[07-08]",
    "SLURM_JOB_NODELIST": "gpu-a[07-08]",
}


def test_an_srun_task_gets_torchruns_variables():
    env = dict(SRUN_TASK)
    exported = export_torchrun_env(env, gpus=0)  # a CPU task
    expected = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "gpu-a07",  # the step's first host: task 0 runs there
        "MASTER_PORT": str(10000 + 4242 % 20000),
    }
    assert exported == expected
    assert {k: env[k] for k in expected} == expected


@pytest.mark.parametrize("gpus, local_rank", [(4, "1"), (1, "0"), (0, "1")])
def test_local_rank_is_the_tasks_own_gpu(gpus, local_rank):
    """All 4 of the node's GPUs visible: GPU SLURM_LOCALID; one GPU bound to the task
    (--gpus-per-task=1): device 0, the only one it sees; a CPU: SLURM_LOCALID."""
    assert export_torchrun_env(dict(SRUN_TASK), gpus=gpus)["LOCAL_RANK"] == local_rank


def test_torchrun_wins_and_nothing_is_set_outside_an_srun_step():
    torchrun = dict(SRUN_TASK, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    assert export_torchrun_env(torchrun) == {}
    assert torchrun["WORLD_SIZE"] == "2" and "MASTER_ADDR" not in torchrun
    batch_script = {k: v for k, v in SRUN_TASK.items() if k != "SLURM_STEP_ID"}
    assert export_torchrun_env(batch_script) == {} and "RANK" not in batch_script
    assert export_torchrun_env({}) == {}


def test_a_plain_process_is_a_world_of_one():
    """``python examples/pretrain_gpt_tst.py ...`` in a shell or the batch script: rank 0 of 1
    on a free local port (Megatron-LM alone stops on the missing MASTER_ADDR)."""
    batch_script = {k: v for k, v in SRUN_TASK.items() if k != "SLURM_STEP_ID"}
    for env in (batch_script, {}):
        exported = one_process_env(env)
        assert {k: exported[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")} == {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
        }
        assert 0 < int(exported["MASTER_PORT"]) < 65536
    assert one_process_env({"MASTER_PORT": "29999"})["MASTER_PORT"] == "29999"
    assert one_process_env({"RANK": "1", "WORLD_SIZE": "2"}) == {}


def test_a_malformed_node_list_is_one_config_error():
    env = dict(SRUN_TASK, SLURM_STEP_NODELIST="gpu-a[07-08", SLURM_JOB_NODELIST="gpu-a[07-08")
    with pytest.raises(ConfigError, match="bad Slurm hostlist"):
        export_torchrun_env(env)
    assert "RANK" not in env


def test_wsd_without_its_decay_length_is_refused_before_the_model_is_built():
    """Megatron-LM asserts on it in ``OptimizerParamScheduler`` after building the model."""
    import types

    from tst_megatron.training.checks.unsupported import late_megatron_problems

    def args(**kw):
        base = dict(
            lr_decay_style="WSD",
            train_iters=100,
            lr_wsd_decay_iters=None,
            lr_wsd_decay_samples=None,
            full_validation=False,
            eval_interval=10,
            skip_train=False,
            train_samples=None,
            lr=1e-3,
            finetune=False,
            load=None,
            pretrained_checkpoint=None,
        )
        return types.SimpleNamespace(**(base | kw))

    (line,) = late_megatron_problems(args())
    assert "--lr-wsd-decay-iters" in line and "\n" not in line
    (line,) = late_megatron_problems(args(train_iters=None, train_samples=800))
    assert "--lr-wsd-decay-samples" in line
    assert late_megatron_problems(args(lr_wsd_decay_iters=10)) == []
    assert late_megatron_problems(args(lr_decay_style="cosine")) == []


def test_what_megatron_lm_s_scheduler_or_loader_needs_is_refused_before_the_model_is_built():
    """No iterations or samples, no --lr (get_optimizer_param_scheduler raises after the
    model is built), --finetune with nothing to load (it would silently start from scratch)."""
    import types

    from tst_megatron.training.checks.unsupported import late_megatron_problems

    base = dict(
        lr_decay_style="cosine", train_iters=100, train_samples=None, lr=1e-3,
        full_validation=False, eval_interval=10, skip_train=False, finetune=False,
        load=None, pretrained_checkpoint=None,
    )  # fmt: skip
    (line,) = late_megatron_problems(types.SimpleNamespace(**(base | {"train_iters": None})))
    assert "--train-iters or --train-samples" in line
    (line,) = late_megatron_problems(types.SimpleNamespace(**(base | {"lr": None})))
    assert line.startswith("--lr is required")
    # --finetune without a checkpoint: stock Megatron-LM trains from fresh weights (a note)
    assert late_megatron_problems(types.SimpleNamespace(**(base | {"finetune": True}))) == []
    from tst_megatron.training.checks import unsupported

    launch = types.SimpleNamespace(args=types.SimpleNamespace(**(base | {"finetune": True})))
    (note,) = unsupported.notes(launch)
    assert note.startswith("--finetune without --load") and "fresh weights" in note
    launch.args.load = "/ckpt"
    assert unsupported.notes(launch) == []
    ok = base | {"finetune": True, "load": "/ckpt"}
    assert late_megatron_problems(types.SimpleNamespace(**ok)) == []
    skip = base | {"skip_train": True, "train_iters": None, "lr": None, "eval_interval": None}
    assert late_megatron_problems(types.SimpleNamespace(**skip)) == []


def test_a_world_size_without_a_rank_is_refused_in_one_line():
    """``WORLD_SIZE=2 python examples/pretrain_gpt_tst.py ...`` (no torchrun): the checks
    would validate a world of 2 while the process trains alone; one line, status 2."""
    with pytest.raises(ConfigError, match="WORLD_SIZE=2 is set but RANK is not: start the 2"):
        one_process_env({"WORLD_SIZE": "2"})
    assert one_process_env({"WORLD_SIZE": "1"})["WORLD_SIZE"] == "1"
