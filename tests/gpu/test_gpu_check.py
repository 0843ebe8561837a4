"""scripts/gpu_check.sh on a machine without a GPU: it parses, exits at once saying so, and
every configuration it would train passes the trainer's validation for a CUDA device."""

import importlib.util
import os
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")


def _load():
    spec = importlib.util.spec_from_file_location(
        "gpu_check", os.path.join(ROOT, "tests", "gpu", "gpu_check.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _has_gpu() -> bool:
    if not shutil.which("nvidia-smi"):
        return False
    return "GPU" in subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout


def test_script_parses():
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0
    assert os.access(SCRIPT, os.X_OK)
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "gpu", "gpu_check.py"), "--help"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and "--output" in result.stdout


@pytest.mark.skipif(_has_gpu(), reason="a GPU is here: the script would run the checks")
def test_without_a_gpu_it_exits_at_once_saying_so():
    start = time.time()
    result = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "no NVIDIA GPU" in result.stderr and "nothing was checked" in result.stderr
    assert time.time() - start < 10


def test_its_configurations_pass_validation():
    gpu_check = _load()
    gpu_check.validate_all()  # raises ConfigError naming the flag otherwise
    names = set(gpu_check.RUNS)
    assert {"local bf16", "TE bf16", "TE FP8 delayed", "TE FP8 current"} <= names
    for name, (_extra, reference, _) in gpu_check.RUNS.items():
        assert reference is None or reference in names
        argv = gpu_check.argv_of(name)
        assert ("--fp8-format" in argv) == ("FP8" in name)
        assert ("transformer_engine" in argv) == name.startswith("TE")
    grouped = gpu_check.argv_of("TE distopt alltoall grouped")
    for flag in ("--use-distributed-optimizer", "--moe-grouped-gemm", "alltoall"):
        assert flag in grouped
    recipes = {
        gpu_check.argv_of(n)[gpu_check.argv_of(n).index("--fp8-recipe") + 1]
        for n in names
        if "FP8" in n
    }
    assert recipes == {"delayed", "tensorwise"}  # delayed and current scaling


def test_a_bad_configuration_would_be_caught(monkeypatch):
    from tst_megatron.errors import ConfigError

    gpu_check = _load()
    monkeypatch.setitem(
        gpu_check.RUNS,
        "bad",
        (gpu_check.FP8 + ["--seq-length", "24", "--micro-batch-size", "1"], None, ""),
    )
    with pytest.raises(ConfigError, match="multiple of 16"):
        gpu_check.validate_all()


def test_without_transformer_engine_its_rows_say_skipped(monkeypatch):
    # the lent H200 has no Transformer Engine: the TE/FP8 rows are skipped, the rest run
    module = _load()
    trained = []

    def fake_train(argv, log):
        trained.append(argv)
        return {"train": {i: 5.0 for i in range(1, module.N + 1)}}

    monkeypatch.setattr(module, "te_installed", lambda: False)
    monkeypatch.setattr(module, "_train", fake_train)
    rows = []
    results = module.check_training(rows, "log")
    module.check_fp8_resume(rows, "log", results)
    assert list(results) == ["local bf16"] and len(trained) == 1
    te_rows = [r for r in rows if r[1] == module.NO_TE]
    assert len(te_rows) == len(module.RUNS) - 1 + 1  # every TE run, and the FP8 resume
    assert all(r[2] == "-" for r in te_rows)
