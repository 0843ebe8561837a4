"""Fixtures shared by the test directories: free ports and the launcher as a subprocess.

Helpers that run inside spawned processes (the launcher's child, its readers) live in
:mod:`tests.launcher` and :mod:`tests.distributed.harness`: a spawned child imports them by
name, so they cannot be fixtures.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.launcher import ROOT
from tests.ports import free_port

# Megatron-LM's pretrain() warms up its torch.compile'd fused kernels (bias + SwiGLU/GeLU,
# bias + dropout + add) whatever the flags say (``set_jit_fusion_options``; its
# ``--disable-jit-fuser`` comes after the decorators ran): on a CPU an inductor C++ compile,
# about 5 s per process, of kernels a CPU run never calls (the launcher's CPU_FLAGS turn those
# fusions off). The tests skip it: every process they start (spawned children, launcher
# subprocesses, torchrun and Slurm steps) inherits this, so dynamo runs the warm-up eagerly.
# A user's run still compiles them (docs/design.md, "megatron-core on the CPU").
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


@pytest.fixture
def port() -> int:
    """A free TCP port on 127.0.0.1 (for ``MASTER_PORT``, ``torchrun --master_port``)."""
    return free_port()


@pytest.fixture
def launcher_env(port) -> dict:
    """The environment of a 1-process launcher run: this one plus ``PYTHONPATH`` = the
    repository, torchrun's variables for rank 0 of 1 and a free ``MASTER_PORT``."""
    return {
        **os.environ,
        "PYTHONPATH": ROOT,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


@pytest.fixture
def run_launcher(launcher_env, tmp_path):
    """``run_launcher(*flags, timeout=600)``: ``examples/pretrain_gpt_tst.py flags`` as one
    process in ``tmp_path`` with :func:`launcher_env`; returns the ``CompletedProcess`` (text
    ``stdout``/``stderr``)."""

    def run(*flags: str, timeout: int = 600) -> subprocess.CompletedProcess:
        script = os.path.join(ROOT, "examples", "pretrain_gpt_tst.py")
        return subprocess.run(
            [sys.executable, script, *flags],
            capture_output=True,
            text=True,
            env=launcher_env,
            cwd=tmp_path,
            timeout=timeout,
        )

    return run
