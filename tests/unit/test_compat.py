"""megatron-core >=0.19,<0.20: what the project assumes of it (the null tokenizer, the lazily
imported checkpoint writer) and the version range of the CPU runtime."""

import subprocess
import sys
import textwrap

import pytest


def _run(code):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "version,ok",
    [
        ("0.19.0", True),
        ("0.19.2", True),
        ("0.19.9", True),
        ("0.19.0rc1", False),
        ("0.16.1", False),
        ("0.18.2", False),
        ("0.20.0", False),
        ("0.20.0rc0", False),
        ("unknown", False),
    ],
)
def test_cpu_runtime_accepts_the_supported_range(monkeypatch, version, ok):
    import megatron.core

    from tst_megatron.runtime import cpu

    monkeypatch.setattr(megatron.core, "__version__", version)
    if ok:
        assert cpu.check_version() == version
    else:
        with pytest.raises(RuntimeError, match=r"supports megatron-core>=0\.19,<0\.20 but"):
            cpu.check_version()


def test_supported_range_is_the_declared_dependency():
    import re
    from pathlib import Path

    from tst_megatron.runtime import cpu

    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    declared = re.search(r'"megatron-core([^"]*)"', pyproject).group(1)
    assert declared == cpu.SUPPORTED_MEGATRON_CORE


@pytest.mark.parametrize("vocab_size", [2, 128, 50257])
def test_null_tokenizer_has_exactly_vocab_size_ids_and_eod_last(vocab_size):
    """What the launcher's mock-data and data checks assume of Megatron-LM's NullTokenizer."""
    from tests.unit.test_data_boundary import null_tokenizer

    tokenizer = null_tokenizer(vocab_size)
    assert tokenizer.vocab_size == vocab_size
    assert tokenizer.eod == vocab_size - 1
    ids = [0, vocab_size - 1, vocab_size // 2]
    assert tokenizer.tokenize(" ".join(map(str, ids))) == ids


def test_checkpoint_writer_runs_on_the_cpu_runtime():
    # From 0.17 the torch_dist strategy imports its writer (filesystem_async, ...) only when
    # saving; those modules call torch.cuda.synchronize() and make CUDA tensors, so they must
    # be redirected too. Save and load once, then check every checkpointing module loaded.
    result = _run("""
        import os, tempfile, torch
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
        from tst_megatron.runtime import cpu
        cpu.enable()
        import sys
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        if __name__ == "__main__":
            weight = torch.arange(6.0).reshape(2, 3)
            with tempfile.TemporaryDirectory() as d:
                dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weight)}, d)
                target = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))}
                loaded = dist_checkpointing.load(target, d)
            assert torch.equal(loaded["w"], weight)
            missed = sorted(
                name for name, module in sys.modules.items()
                if name.startswith("megatron.core.dist_checkpointing")
                and getattr(module, "torch", None) is torch
            )
            assert not missed, f"not redirected to the CPU: {missed}"
            print("OK")
        """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK" in result.stdout


def test_setup_refuses_an_unsupported_python(tmp_path):
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    old = tmp_path / "python3.9"
    old.write_text("#!/bin/sh\nexec python3 -c 'import sys; sys.exit(1)'\n")  # not 3.12
    old.chmod(0o755)
    result = subprocess.run(
        ["bash", os.path.join(root, "scripts", "setup.sh")],
        env=dict(os.environ, PYTHON=str(old), VENV=str(tmp_path / "venv")),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "no Python 3.12 found" in result.stderr and "PYTHON=" in result.stderr
    assert not (tmp_path / "venv").exists()
