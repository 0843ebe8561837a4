"""The launcher's reading of Slurm's environment (one process, no Slurm daemons needed).

Hostlist expansion is checked against lists written out by hand here and, when the Slurm
client is installed, against ``scontrol show hostnames`` itself (it needs no daemon).
"""

import subprocess

import pytest

from tests.slurm.local_cluster import Unavailable, ensure_installed
from tst_megatron.runtime import resolve_process
from tst_megatron.runtime.slurm import PORT_BASE, PORT_SPAN, expand_hostlist, slurm_rendezvous

HOSTLISTS = {
    "node01": ["node01"],
    "node[01-03,07]": ["node01", "node02", "node03", "node07"],
    "gpu[8-10],login": ["gpu8", "gpu9", "gpu10", "login"],
    "a[08-10]": ["a08", "a09", "a10"],
    "r[1-2]n[1,3]": ["r1n1", "r1n3", "r2n1", "r2n3"],
    "dgx-h100-[001-002],dgx-h100-010": ["dgx-h100-001", "dgx-h100-002", "dgx-h100-010"],
}


@pytest.mark.parametrize("hostlist", sorted(HOSTLISTS))
def test_expand_hostlist(hostlist):
    assert expand_hostlist(hostlist) == HOSTLISTS[hostlist]


def test_expand_hostlist_agrees_with_scontrol(tmp_path):
    try:
        ensure_installed()  # apt-get install slurm-wlm munge when missing (root)
    except Unavailable as exc:
        pytest.skip(f"no Slurm client: {exc}")
    conf = tmp_path / "slurm.conf"  # scontrol wants a configuration, not a controller
    conf.write_text("ClusterName=hostlist\nSlurmctldHost=localhost\n")
    for hostlist, expected in HOSTLISTS.items():
        out = subprocess.run(
            ["scontrol", "show", "hostnames", hostlist],
            capture_output=True,
            text=True,
            check=True,
            env={"SLURM_CONF": str(conf)},
        ).stdout.split()
        assert out == expected == expand_hostlist(hostlist), hostlist


@pytest.mark.parametrize(
    "hostlist,message",
    [
        ("", "it is empty"),
        ("n[1-2", "'[' without ']'"),
        ("n1-2]", "']' without '['"),
        ("n[3-1]", "runs backwards"),
        ("n[a-b]", "is not N or N-M"),
        ("n1,,n2", "empty name"),
        ("n[1[2]]", "nested"),
    ],
)
def test_bad_hostlist_is_one_line(hostlist, message):
    with pytest.raises(ValueError) as info:
        expand_hostlist(hostlist)
    assert message in str(info.value) and "\n" not in str(info.value)


STEP = {  # what srun exports to task 3 of 8 on the second of two nodes (values from a real step)
    "SLURM_JOB_ID": "1234",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NODELIST": "node[07-08]",
    "SLURM_JOB_NODELIST": "node[06-08]",
}


def test_srun_task_takes_rank_and_rendezvous_from_slurm():
    info = resolve_process(STEP, device="cpu")
    assert (info.launcher, info.rank, info.local_rank) == ("srun", 3, 1)
    assert info.world_size == 4  # the step's task count, not the job's
    assert info.master_addr == "node07"  # first node of the step, not of the job
    assert info.master_port == PORT_BASE + 1234 % PORT_SPAN
    job_only = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP_")} | {
        "SLURM_STEPID": "0"
    }
    fallback = resolve_process(job_only, device="cpu")
    assert (fallback.world_size, fallback.master_addr) == (8, "node06")


def test_exported_rendezvous_and_torchrun_win():
    exported = resolve_process(
        STEP | {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "6000"}, device="cpu"
    )
    assert (exported.master_addr, exported.master_port, exported.rank) == ("10.0.0.1", 6000, 3)
    torchrun = {
        "RANK": "9",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "node06",
        "MASTER_PORT": "29400",
    }
    info = resolve_process(STEP | torchrun, device="cpu")
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("torchrun", 9, 16, 1)
    assert (info.master_addr, info.master_port) == ("node06", 29400)


def test_batch_script_itself_is_one_process():
    """The batch shell has SLURM_PROCID=0 and the job's SLURM_NTASKS but no step id."""
    batch = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP")} | {
        "SLURM_PROCID": "0"
    }
    info = resolve_process(batch, device="cpu")
    assert (info.launcher, info.rank, info.world_size) == ("none", 0, 1)


def test_bad_slurm_environment_is_a_clear_error():
    with pytest.raises(ValueError, match="outside"):
        resolve_process(STEP | {"SLURM_PROCID": "4"}, device="cpu")
    no_nodes = {k: v for k, v in STEP.items() if "NODELIST" not in k}
    with pytest.raises(ValueError, match="export MASTER_ADDR"):
        slurm_rendezvous(no_nodes)


@pytest.mark.parametrize("visible,expected", [(8, 1), (1, 0)])
def test_gpu_index_with_all_gpus_or_one_bound_gpu_per_task(monkeypatch, visible, expected):
    """Local rank 1 uses cuda:1 when it sees the node's 8 GPUs, cuda:0 under --gpus-per-task=1."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    info = resolve_process(STEP, device="auto")
    assert (info.device, info.backend) == (torch.device("cuda", expected), "nccl")
