"""scripts/gpu_check.sh on a machine without a GPU: it parses and exits at once saying so; every
launch line it would train passes the launcher's --dry-run checks as a CUDA run; and the CPU
parts of tests/gpu/gpu_check.py (the launch command, reading Megatron-LM's log lines, the
skipped rows without Transformer Engine, the table) work."""

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from tests.ports import free_port

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
    fetch = os.path.join(ROOT, "scripts", "fetch_gpu_wheels.sh")
    assert subprocess.run(["bash", "-n", fetch]).returncode == 0
    # what the launcher imports beyond torch is installed from the wheels
    for package in ("megatron-core", "pyyaml", "psutil", "tqdm", "sentencepiece"):
        assert package in open(SCRIPT).read() and package in open(fetch).read(), package
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "gpu", "gpu_check.py"), "--help"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert result.returncode == 0 and "--output" in result.stdout


@pytest.mark.skipif(_has_gpu(), reason="a GPU is here: the script would run the checks")
def test_without_a_gpu_it_exits_at_once_saying_so():
    start = time.time()
    result = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "no NVIDIA GPU" in result.stderr and "nothing was checked" in result.stderr
    assert time.time() - start < 10


def test_its_launch_lines_pass_the_launchers_checks():
    gpu_check = _load()
    gpu_check.validate_all()  # raises ConfigError naming the problems otherwise
    names = set(gpu_check.RUNS)
    assert {"local bf16", "TE bf16", "TE FP8 delayed", "TE FP8 current"} <= names
    for name, (_extra, reference, _) in gpu_check.RUNS.items():
        assert reference is None or reference in names
        argv = gpu_check.argv_of(name)
        assert argv[:2] == ["--device", "cuda"] and "--bf16" in argv
        assert ("--fp8-format" in argv) == ("FP8" in name)
        impl = argv[len(argv) - 1 - argv[::-1].index("--transformer-impl") + 1]
        assert impl == ("transformer_engine" if "TE" in name.split() else "local")
        hybrid = "--hybrid-layer-pattern" in argv
        assert hybrid == name.startswith("hybrid") == ("--num-layers" not in argv)
        assert gpu_check.launcher_of(name) == (
            gpu_check.HYBRID_LAUNCHER if hybrid else gpu_check.LAUNCHER
        )
    # the hybrid MoE run is the GPT reference run's 2 MoE blocks as 4 hybrid layers
    assert gpu_check.RUNS["hybrid local bf16"][1] == "local bf16"
    pattern = gpu_check.argv_of("hybrid local bf16")
    assert pattern[pattern.index("--hybrid-layer-pattern") + 1] == "*E*E"
    gpt = gpu_check.argv_of("local bf16")
    at = gpt.index("--num-layers")
    hybrid_moe = gpu_check.argv_of("hybrid local bf16")
    assert hybrid_moe == gpt[:at] + gpt[at + 2 :] + gpu_check.HYBRID_MOE
    mamba = gpu_check.argv_of("hybrid TE Mamba")
    assert "M" in mamba[mamba.index("--hybrid-layer-pattern") + 1]
    local = gpu_check.argv_of("local bf16")
    assert "--no-rope-fusion" in local and "--no-gradient-accumulation-fusion" in local
    grouped = gpu_check.argv_of("TE distopt alltoall grouped")
    for flag in ("--use-distributed-optimizer", "--moe-grouped-gemm", "alltoall"):
        assert flag in grouped
    local_distopt = gpu_check.argv_of("local distopt alltoall")  # runs without TE
    assert "--use-distributed-optimizer" in local_distopt and "alltoall" in local_distopt
    recipes = {
        gpu_check.argv_of(n)[gpu_check.argv_of(n).index("--fp8-recipe") + 1]
        for n in names
        if "FP8" in n
    }
    assert recipes == {"delayed", "tensorwise"}  # delayed and current scaling
    save, resume = gpu_check.save_argv("c"), gpu_check.resume_argv("c")
    assert save[save.index("--save-interval") + 1] == str(gpu_check.RESUME_AT)
    assert resume[resume.index("--ckpt-step") + 1] == str(gpu_check.RESUME_AT)
    assert resume[resume.index("--load") + 1] == "c"


def test_a_bad_launch_line_would_be_caught(monkeypatch):
    from tst_megatron.errors import ConfigError

    gpu_check = _load()
    monkeypatch.setitem(gpu_check.RUNS, "bad", (["--num-attention-heads", "3"], None, ""))
    with pytest.raises(ConfigError, match="bad"):
        gpu_check.validate_all()


#: Megatron-LM's training_log lines as 0.19 prints them (shortened): phase 1 reports ``mce
#: loss``; after the switch ``lm loss``, and ``mce loss`` stays at 0.
LOG = """\
 [2026-12-01 15:00:00] iteration        1/      20 | consumed samples:            8 | \
elapsed time per iteration (ms): 812.3 | learning rate: 5.000000E-04 | global batch size: \
    8 | mce loss: 6.951234E+00 | loss scale: 1.0 | grad norm: 1.234 |
 TST: iteration        1 | raw tokens per sample: 512 | raw tokens: 4096 |
 [2026-12-01 15:00:01] iteration        8/      20 | consumed samples:           64 | \
elapsed time per iteration (ms): 30.1 | mce loss: 6.500000E+00 | loss scale: 1.0 |
 [2026-12-01 15:00:02] iteration        9/      20 | consumed samples:           72 | \
elapsed time per iteration (ms): 20.0 | mce loss: 0.000000E+00 | lm loss: 6.700000E+00 | \
loss scale: 1.0 |
 validation loss at iteration 20 | lm loss value: 6.1E+00 |
"""


def test_losses_are_read_from_megatron_lms_log_lines():
    gpu_check = _load()
    assert gpu_check.parse_losses(LOG) == {1: 6.951234, 8: 6.5, 9: 6.7}


def test_train_runs_the_launcher_on_one_process(monkeypatch, tmp_path):
    gpu_check = _load()
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append((cmd, kwargs))
        return subprocess.CompletedProcess(cmd, 0, stdout=LOG, stderr="")

    monkeypatch.setattr(gpu_check.subprocess, "run", fake_run)
    log = str(tmp_path / "log")
    result = gpu_check._train(gpu_check.argv_of("local bf16"), log)
    assert result["train"] == {1: 6.951234, 8: 6.5, 9: 6.7}
    ((cmd, kwargs),) = calls
    assert cmd == [sys.executable, gpu_check.LAUNCHER, *gpu_check.argv_of("local bf16")]
    assert kwargs["cwd"] == ROOT and os.path.exists(os.path.join(ROOT, gpu_check.LAUNCHER))
    env = kwargs["env"]
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("0", "1", "0")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == ROOT
    assert "mce loss" in open(log).read()
    monkeypatch.setattr(
        gpu_check.subprocess,
        "run",
        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 2, stdout="", stderr="error: x"),
    )
    with pytest.raises(RuntimeError, match="exited 2"):
        gpu_check._train(["--x"], log)


def test_without_transformer_engine_its_rows_say_skipped(monkeypatch):
    # the lent H200 has no Transformer Engine: the TE/FP8 rows are skipped, the rest run
    module = _load()
    trained = []

    def fake_train(argv, log, launcher=None, gpus=1):
        trained.append(argv)
        return {"train": {i: 5.0 for i in range(1, module.N + 1)}}

    monkeypatch.setattr(module, "te_installed", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(module, "_train", fake_train)
    rows = []
    results = module.check_training(rows, "log")
    module.check_fp8_resume(rows, "log", results)
    local = [n for n in module.RUNS if "TE" not in n.split()]
    assert local == [
        "local bf16",
        "local distopt alltoall",
        "local cudagraph",
        "local EP2 alltoall",
        "local EP2 overlap",
        "hybrid local bf16",
    ]
    assert list(results) == local and trained == [module.argv_of(n) for n in local]
    assert [r[2] for r in rows if r[1] != module.NO_TE] == ["pass"] * 6
    te_rows = [r for r in rows if r[1] == module.NO_TE]
    assert len(te_rows) == len(module.RUNS) - len(local) + 1  # every TE run, the FP8 resume
    assert all(r[2] == "-" for r in te_rows)
    assert module.NO_TE == "skipped: Transformer Engine not installed"
    # a run that misses iterations (no switch reached) or goes NaN fails
    monkeypatch.setattr(module, "_train", lambda *a: {"train": {1: 5.0, 2: math.nan}})
    rows = []
    module.check_training(rows, "log")
    assert rows[0][2] == "FAIL"
    # a run whose launcher fails is a FAIL row, and the runs after it still run
    calls = []

    def failing(argv, log, launcher=None, gpus=1):
        calls.append(argv)
        raise RuntimeError("launcher exited 1; see log")

    monkeypatch.setattr(module, "_train", failing)
    rows = []
    assert module.check_training(rows, "log") == {}
    assert len(calls) == 1  # the reference failed: the runs compared with it are not started
    assert rows[0] == (module.RUNS["local bf16"][2], "launcher exited 1; see log", "FAIL")
    assert all(r[2] in ("FAIL", "-") for r in rows) and len(rows) == len(module.RUNS)


def test_the_expert_parallel_rows_take_two_gpus(monkeypatch, tmp_path):
    """The all-to-all overlap needs EP 2: its rows run 2 processes through torchrun, pass the
    launcher's checks at world size 2, and are skipped (not failed) on a 1-GPU machine."""
    module = _load()
    assert module.gpus_of("local EP2 overlap") == module.gpus_of("local EP2 alltoall") == 2
    assert module.gpus_of("local bf16") == 1
    assert "--overlap-moe-expert-parallel-comm" in module.argv_of("local EP2 overlap")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert module.skip_reason("local EP2 overlap") == "skipped: needs 2 GPUs, this machine has 1"
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append((cmd, kwargs))
        return subprocess.CompletedProcess(cmd, 0, stdout=LOG, stderr="")

    monkeypatch.setattr(module.subprocess, "run", fake_run)
    module._train(module.argv_of("local EP2 overlap"), str(tmp_path / "log"), gpus=2)
    ((cmd, kwargs),) = calls
    assert cmd[:5] == [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    assert cmd[7:] == [module.LAUNCHER, *module.argv_of("local EP2 overlap")]
    assert "RANK" not in kwargs["env"] and "WORLD_SIZE" not in kwargs["env"]


def test_the_mamba_row_is_skipped_without_mamba_ssm(monkeypatch):
    module = _load()
    monkeypatch.setattr(module, "te_installed", lambda: True)
    monkeypatch.setattr(module, "mamba_ssm_installed", lambda: False)
    assert module.skip_reason("hybrid TE Mamba") == module.NO_MAMBA
    assert module.skip_reason("hybrid local bf16") is None
    monkeypatch.setattr(module, "mamba_ssm_installed", lambda: True)
    assert module.skip_reason("hybrid TE Mamba") is None
    monkeypatch.setattr(module, "te_installed", lambda: False)
    assert module.skip_reason("hybrid TE Mamba") == module.NO_TE


def test_a_resume_is_compared_without_megatron_lms_halved_line():
    # after a restart at N1 - 1 Megatron-LM 0.19.2 logs iteration N1 + 1 halved (the H200 run:
    # lm loss 3.2036 where the uninterrupted run logged 6.4072, same grad norm)
    module = _load()
    at = module.N1 - 1
    assert module.compared_iterations(at) == [
        i for i in range(at + 2, module.N + 1) if i != module.N1 + 1
    ]
    assert module.compared_iterations(module.RESUME_AT) == list(
        range(module.RESUME_AT + 2, module.N + 1)
    )


def _check_rows_on_a_cpu(call: str) -> list:
    """The rows of ``gpu_check.<call>`` (e.g. ``check_mce_vs_fused_ce(rows, device='cpu')``),
    run in a child process: the check's process group must not outlive it in pytest's (its
    rendezvous port stays bound; a later Slurm test's job would meet it)."""
    code = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('g', {os.path.join(ROOT, 'tests', 'gpu', 'gpu_check.py')!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"rows = []; m.{call}; print(json.dumps(rows))\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT, MASTER_PORT=str(free_port()), RANK="0")
    env.update(WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_mce_row_passes_on_a_cpu():
    # the row's references: a float64 CE (tight) and megatron-core's fused CE, whose gradient
    # is cast to bf16 (the H200's first run failed a 1e-6 bound against it: 3.9e-3)
    rows = _check_rows_on_a_cpu("check_mce_vs_fused_ce(rows, device='cpu')")
    assert len(rows) == 1 and rows[0][2] == "pass", rows


def test_the_chunked_loss_row_passes_on_a_cpu_at_a_small_shape():
    """The GPU check's ``--tst-loss-chunks`` row, CPU-simulated (the live-tensor tracker for
    CUDA's allocator): built and run here, not a GPU result."""
    rows = _check_rows_on_a_cpu(
        "check_chunked_loss(rows, device='cpu', shape=dict(T=128, b=2, h=16, V=4096, chunks=8))"
    )
    assert len(rows) == 2 and all(row[2] == "pass" for row in rows), rows


def test_the_report_is_a_table_of_every_row():
    module = _load()
    rows = [("a check", "loss it 1 6.9", "pass"), ("TE bf16", module.NO_TE, "-")]
    text = module.report(rows, ["## step cost\n\ntable"], 61.4, "FakeGPU, Python 3.12")
    lines = text.splitlines()
    header = lines.index("| check | result | verdict |")
    assert lines[header + 1] == "|---|---|---|"
    assert lines[header + 2 : header + 4] == [
        "| a check | loss it 1 6.9 | pass |",
        f"| TE bf16 | {module.NO_TE} | - |",
    ]
    assert "FakeGPU, Python 3.12; 61 s in all." in text
    assert module.LAUNCHER in text and text.rstrip().endswith("table")


@pytest.mark.slow
def test_the_local_run_trains_through_the_switch_on_a_cpu(tmp_path):
    # the reference run's launch line, shortened and on the CPU, through the real launcher:
    # every iteration is logged in both phases and starts near ln V (uniform logits)
    module = _load()
    shrink = ["--device", "cpu", "--train-iters", "4", "--tst-phase1-iters", "2"]
    shrink += ["--eval-interval", "4", "--lr-warmup-iters", "1", "--lr-wsd-decay-iters", "1"]
    shrink += ["--hidden-size", "64", "--ffn-hidden-size", "128", "--moe-ffn-hidden-size", "64"]
    argv = [a for a in module.argv_of("local bf16") if a != "--bf16"] + shrink
    losses = module._train(argv, str(tmp_path / "log"))["train"]
    assert sorted(losses) == [1, 2, 3, 4], open(tmp_path / "log").read()[-3000:]
    assert all(math.isfinite(v) for v in losses.values())
    assert abs(losses[1] - math.log(1024)) < 0.5
    # the hybrid row's launch line, shortened the same way: the same seed builds the same
    # weights as 4 hybrid layers, so the losses it is compared with on the GPU are equal here
    name = "hybrid local bf16"
    argv = [a for a in module.argv_of(name) if a != "--bf16"] + shrink
    hybrid = module._train(argv, str(tmp_path / "log"), module.launcher_of(name))["train"]
    assert hybrid == losses, open(tmp_path / "log").read()[-3000:]


@pytest.mark.slow
def test_the_real_size_rows_run_on_a_cpu_at_a_tiny_size(tmp_path):
    """The real-size rows' code on a CPU (``--device cpu --size smoke``): real text built from
    this machine's installed packages with the carried tokenizer, step_cost.py's JSON read back
    into a row and a section. On the GPU the same code runs the real shapes."""
    module = _load()
    rows, sections = [], []
    log = str(tmp_path / "log")
    extra = ("--bag-sizes", "4", "--repeats", "1", "--rounds", "2")
    module.check_real_size(
        rows, sections, log, device="cpu", sizes=("smoke",), extra=extra, text_bytes=400_000
    )
    assert len(rows) == 1 and len(sections) == 1, open(log).read()[-3000:]
    what, summary, verdict = rows[0]
    assert "--size smoke" in what and verdict in ("pass", "FAIL"), rows
    for part in ("time phase 1 / baseline", "memory phase 1 / baseline", "TFLOP/s phase 1"):
        assert part in summary, summary
    assert "real text" in sections[0] and "code32k.model" in sections[0]
    assert "| 4 |" in sections[0]


def test_the_real_size_summary_holds_the_goals():
    module = _load()
    arm = {"time": 1.0, "time_min": 1.0, "peak": 100, "tokens": 1, "flops": 2e12, "n": 4}
    measurement = {
        "matmul_tflops": 800.0,
        "results": {"4": {"1": dict(arm, time=1.01), "2": arm, "base": arm}},
    }
    text, ok = module.real_size_summary(measurement)
    assert ok and "time phase 1 / baseline 1.010" in text and "0.003 of 800" in text
    for key in ("1", "2", "base"):  # the allocator's counters (CUDA) are reported
        measurement["results"]["4"][key] = dict(
            measurement["results"]["4"][key], allocator=[3.0, 2.0, 0.0]
        )
    text, ok = module.real_size_summary(measurement)
    assert ok and "baseline 3.0/2.0/0.0" in text, text
    measurement["results"]["4"]["1"]["peak"] = 105  # one logits-sized tensor more: fails
    assert not module.real_size_summary(measurement)[1]
    measurement["results"]["4"]["1"].update(peak=100, time=1.05)
    assert not module.real_size_summary(measurement)[1]
