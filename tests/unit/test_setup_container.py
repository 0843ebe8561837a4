"""``scripts/setup.sh --container`` (NVIDIA's PyTorch container): installs tst_megatron and
megatron-core into the environment as it is and leaves its torch in place. Tested in a fresh
environment whose "torch" is a container-style pre-release build (``2.8.0a0+nv25.6``, metadata
and a module only): after set-up that exact torch is still the one installed, and nothing else
named torch was added; a torch older than megatron-core 0.19 needs is one line, and nothing is
installed."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _environment(tmp_path, torch_version: str) -> str:
    """A fresh virtual environment holding only a stand-in torch ``torch_version`` (as a
    container's preinstalled build); returns its interpreter."""
    venv = tmp_path / "env"
    subprocess.run([sys._base_executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    package = os.path.join(purelib, "torch")
    info = os.path.join(purelib, f"torch-{torch_version}.dist-info")
    os.makedirs(package)
    os.makedirs(info)
    with open(os.path.join(package, "__init__.py"), "w") as f:
        f.write(f'__version__ = "{torch_version}"\n')
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n")
    for name, text in (("INSTALLER", "pip\n"), ("RECORD", "torch/__init__.py,,\n")):
        with open(os.path.join(info, name), "w") as f:
            f.write(text)
    return python


def _torches(python: str) -> list[str]:
    """Every distribution named torch in ``python``'s environment, as ``name version``."""
    code = (
        "import importlib.metadata as md; print('\\n'.join(sorted(d.metadata['Name'] + ' ' + "
        "d.version for d in md.distributions() if d.metadata['Name'].lower() == 'torch')))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split("\n")[:-1]


def _setup(python: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=python)
    env.pop("VIRTUAL_ENV", None)
    return subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "setup.sh"), "--container"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


@pytest.mark.slow  # about 40 s: pip installs megatron-core and the project's requirements
def test_set_up_in_place_keeps_the_environment_s_torch(tmp_path):
    python = _environment(tmp_path, "2.8.0a0+nv25.6")
    result = _setup(python)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _torches(python) == ["torch 2.8.0a0+nv25.6"]
    first = result.stdout.splitlines()[0]
    assert "torch 2.8.0a0+nv25.6 (kept), megatron-core 0.19." in first, result.stdout
    for name in ("Transformer Engine", "Apex", "grouped_gemm", "flash_attn"):
        assert f"  {name}: not found" in result.stdout, result.stdout
    # the stand-in torch cannot run megatron-core: its files and the other requirements can
    code = (
        "import importlib.util as u, sentencepiece, tensorboard, matplotlib, safetensors; "
        "assert u.find_spec('megatron.core') and u.find_spec('tst_megatron')"
    )
    found = subprocess.run([python, "-c", code], capture_output=True, text=True)
    assert found.returncode == 0, found.stderr[-2000:]


def test_a_torch_older_than_megatron_core_needs_is_one_line(tmp_path):
    python = _environment(tmp_path, "2.5.0a0+nv24.10")
    result = _setup(python)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert "this environment's torch 2.5.0a0+nv24.10 is older than" in result.stderr
    purelib = sysconfig.get_paths(vars={"base": str(tmp_path / "env")})["purelib"]
    assert not [p for p in os.listdir(purelib) if p.startswith("megatron")]
