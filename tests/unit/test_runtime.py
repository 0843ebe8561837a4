"""The runtime without a process group: CPU redirection, the SP norm, layout validation,
and reading rank/world size from torchrun's or Slurm's environment."""

import subprocess
import sys
import textwrap

import pytest
import torch

from tst_megatron.models.layers import SequenceParallelNorm
from tst_megatron.runtime import ParallelConfig, resolve_process


def _run(code):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )


#: Appended to a script that enables the CPU runtime: torch itself still refuses CUDA.
_TORCH_UNTOUCHED = """
try:
    torch.zeros(1, device="cuda")
except (RuntimeError, AssertionError):
    print("REAL_TORCH_UNCHANGED")
"""


def _run_leaving_torch_untouched(code):
    """Runs ``code`` (which imports torch) and then :data:`_TORCH_UNTOUCHED`; both pass."""
    result = _run(textwrap.dedent(code) + _TORCH_UNTOUCHED)
    assert result.returncode == 0, result.stderr
    assert "REAL_TORCH_UNCHANGED" in result.stdout


def test_cpu_enable_is_idempotent_and_scoped():
    _run_leaving_torch_untouched("""
        import torch
        from tst_megatron.runtime import cpu
        assert not cpu.is_enabled()
        cpu.enable(); cpu.enable()
        assert cpu.is_enabled()
        from megatron.core.optimizer import clip_grads
        from megatron.core.transformer.moe import moe_utils
        assert clip_grads.torch.cuda.current_device() == torch.device("cpu")
        t = clip_grads.torch.zeros(1, device="cuda")
        assert t.device.type == "cpu"
        assert moe_utils.te_general_gemm is None
        # torch itself is untouched
        assert torch.cuda.current_device is not clip_grads.torch.cuda.current_device
        """)


def test_cpu_enable_for_megatron_training_loop_is_scoped():
    _run_leaving_torch_untouched("""
        import torch
        from tst_megatron.runtime import cpu
        cpu.enable(training=True)
        from megatron.training import initialize, training
        from megatron.training.utils import common_utils
        # initialize.py asserts CUDA and gates model-parallel init on device_count() > 0
        assert initialize.torch.cuda.is_available() and initialize.torch.cuda.device_count() == 1
        # the rest of the loop sees torch's answer (tensors on 'cuda' land on the CPU)
        assert training.torch.cuda.is_available() == torch.cuda.is_available()
        assert training.torch.cuda.device_count() == 0
        assert training.torch.tensor([1.0], device="cuda").device.type == "cpu"
        # validate_args reads the compute capability when TP or CP > 1
        assert common_utils.get_device_arch_version() == 0
        # get_model's model_module.cuda(...) leaves a provider's model where it is
        m = cpu.keep_on_cpu(torch.nn.Linear(2, 2))
        assert m.cuda(training.torch.cuda.current_device()) is m
        assert m.weight.device.type == "cpu"
        assert torch.nn.Linear(2, 2).cuda is not m.cuda  # other modules keep torch's .cuda
        """)


def test_cpu_enable_after_init_process_group():
    result = _run("""
        import os, torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
        from tst_megatron.runtime import cpu, init_distributed
        cpu.enable()
        info = init_distributed(device="cpu")   # keeps the existing group
        assert info.backend == "gloo" and dist.get_world_size() == 1
        print("OK")
        """)
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout


def test_cpu_enable_rejects_untested_megatron_core(monkeypatch):
    import megatron.core

    from tst_megatron.runtime import cpu

    monkeypatch.setattr(megatron.core, "__version__", "0.99.0")
    with pytest.raises(RuntimeError, match="megatron-core 0.99.0 is installed"):
        cpu.enable()


def test_rng_tracker_forks_cpu_generator():
    result = _run("""
        import os, torch
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
        from tst_megatron.runtime import initialize_model_parallel, ParallelConfig, set_seed, cpu
        cpu.enable()
        initialize_model_parallel(ParallelConfig())
        set_seed(3)
        from megatron.core import tensor_parallel
        before = torch.get_rng_state()
        with tensor_parallel.get_cuda_rng_tracker().fork():
            a = torch.rand(3)
        assert torch.equal(before, torch.get_rng_state()), "fork did not restore the default state"
        with tensor_parallel.get_cuda_rng_tracker().fork():
            b = torch.rand(3)
        assert not torch.equal(a, b), "the tracked state did not advance"
        print("OK")
        """)
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout


@pytest.mark.parametrize(
    "normalization,cls", [("RMSNorm", torch.nn.RMSNorm), ("LayerNorm", torch.nn.LayerNorm)]
)
def test_sequence_parallel_norm(normalization, cls):
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        normalization=normalization,
        use_cpu_initialization=True,
    )
    config.sequence_parallel = True  # set after __post_init__: TP=1 would reject SP
    norm = SequenceParallelNorm(config, 8, eps=1e-6)
    assert isinstance(norm, cls)
    assert all(p.sequence_parallel for p in norm.parameters())
    x = torch.randn(3, 2, 8, dtype=torch.float64)
    ref = (
        torch.nn.functional.rms_norm(x, (8,), eps=1e-6)
        if normalization == "RMSNorm"
        else torch.nn.functional.layer_norm(x, (8,), eps=1e-6)
    )
    torch.testing.assert_close(norm(x.float()).double(), ref, rtol=1e-5, atol=1e-5)
    config.normalization = "L2Norm"
    with pytest.raises(ValueError, match="not supported by the local spec"):
        SequenceParallelNorm(config, 8)


@pytest.mark.parametrize(
    "kwargs,world,message",
    [
        (
            dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
            2,
            "not divisible by TP*PP*CP = 4",
        ),
        (dict(expert_model_parallel_size=4), 2, "not divisible by ETP*EP*PP = 4"),
        (
            dict(tensor_model_parallel_size=0),
            2,
            "--tensor-model-parallel-size must be a positive integer",
        ),
    ],
)
def test_parallel_config_validation(kwargs, world, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        ParallelConfig(**kwargs).validate(world)
    ParallelConfig().validate(world)


def test_resolve_process_from_torchrun_and_slurm():
    torchrun = resolve_process({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, device="cpu")
    assert (torchrun.rank, torchrun.world_size, torchrun.local_rank) == (3, 8, 1)
    assert torchrun.backend == "gloo" and torchrun.device.type == "cpu"
    slurm = resolve_process(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "16",
            "SLURM_LOCALID": "5",
            "SLURM_STEP_ID": "0",
            "SLURM_JOB_NODELIST": "n[1-2]",
        },
        device="cpu",
    )
    assert (slurm.rank, slurm.world_size, slurm.local_rank) == (5, 16, 5)
    assert (slurm.launcher, slurm.master_addr) == ("srun", "n1")  # more in tests/slurm/
    both = resolve_process(
        {"RANK": "0", "SLURM_PROCID": "5", "WORLD_SIZE": "2", "SLURM_NTASKS": "9"}, device="cpu"
    )
    assert (both.rank, both.world_size) == (0, 2)  # torchrun wins
    assert resolve_process({}, device="cpu").world_size == 1
    with pytest.raises(ValueError, match="--device must be"):
        resolve_process({}, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_process({}, device="cuda")
