"""The sbatch template's launcher command line, without Slurm (``TST_DRY_RUN=1``): the H100
defaults, a dense variant, a bigger layout, a HybridModel (``HYBRID_LAYER_PATTERN``: the hybrid
launcher) and the CPU variant each pass the launcher's dry run (Megatron-LM's parser and
``validate_args``, its ``TransformerConfig``, the TST checks) for their world size, and carry
what preemption needs."""

import shlex
import subprocess
from pathlib import Path

import pytest

from tst_megatron.models.family import GPT, HYBRID
from tst_megatron.training.validate import check

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "slurm" / "pretrain_tst_moe.sbatch"
DATA = {"DATA_PATH": "/data/corpus_text_document", "TOKENIZER_MODEL": "/data/tokenizer.model"}

CASES = {  # name: (variables, world size, device)
    "moe_2x8_h100_defaults": (DATA, 16, "cuda"),
    "moe_4x8_tp2_pp2_ep4": (
        DATA | {"TP": "2", "PP": "2", "EP": "4", "GLOBAL_BATCH_SIZE": "256"},
        32,
        "cuda",
    ),
    "dense_2x8_tp2": (
        DATA | {"NUM_EXPERTS": "0", "EP": "1", "TP": "2", "NUM_LAYERS": "24"},
        16,
        "cuda",
    ),
    "hybrid_moe_2x8_h100": (DATA | {"HYBRID_LAYER_PATTERN": "*E" * 16}, 16, "cuda"),
    "cpu_variant": (
        {
            "TST_DEVICE": "cpu",
            "VOCAB_SIZE": "128",
            "NUM_LAYERS": "2",
            "HIDDEN_SIZE": "64",
            "FFN_HIDDEN_SIZE": "128",
            "SEQ_LENGTH": "64",
            "NUM_EXPERTS": "4",
            "MOE_FFN_HIDDEN_SIZE": "64",
            "MOE_ROUTER_TOPK": "2",
            "EP": "2",
            "GLOBAL_BATCH_SIZE": "4",
            "TRAIN_ITERS": "40",
            "LR_WARMUP_ITERS": "2",
        },
        2,
        "cpu",
    ),
}
#: the CPU variant as a HybridModel: its 2 MoE blocks as the pattern, no --num-layers
CASES["hybrid_cpu_variant"] = (
    {k: v for k, v in CASES["cpu_variant"][0].items() if k != "NUM_LAYERS"}
    | {"HYBRID_LAYER_PATTERN": "*E*E"},
    2,
    "cpu",
)


def run_template(
    tmp_path, variables: dict, check: bool = False, line=()
) -> subprocess.CompletedProcess:
    """The template run by bash with ``TST_DRY_RUN=1`` and ``variables`` in a bare environment
    (job ``tst-job``, runs under ``tmp_path/runs``), from the repository, with ``line`` (a
    launcher and its flags) as its arguments: it prints its launcher command line."""
    env = {
        "PATH": "/usr/bin:/bin",
        "SLURM_JOB_NAME": "tst-job",
        "SLURM_SUBMIT_DIR": str(REPO),
        "RUNS_DIR": str(tmp_path / "runs"),
        "TST_DRY_RUN": "1",
        **variables,
    }
    command = ["bash", str(TEMPLATE), *line]
    return subprocess.run(command, env=env, capture_output=True, text=True, check=check, cwd=REPO)


def dry_run(tmp_path, variables: dict) -> list:
    """The launcher flags the template would run with ``variables`` (its script checked: the
    hybrid launcher where ``HYBRID_LAYER_PATTERN`` is set, else the GPT one)."""
    out = run_template(tmp_path, variables, check=True)
    argv = shlex.split(out.stdout)
    script = (
        "pretrain_hybrid_tst.py" if variables.get("HYBRID_LAYER_PATTERN") else "pretrain_gpt_tst.py"
    )
    assert argv[:2] == [str(REPO / ".venv" / "bin" / "python"), str(REPO / "examples" / script)]
    return argv[2:]


def checked(argv: list, world: int, monkeypatch) -> object:
    """The launcher's dry-run check of ``argv`` at ``world`` processes (as the template's
    environment sets it for a CUDA run; the hybrid launcher's for a hybrid pattern); fails
    with every problem found."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    family = HYBRID if "--hybrid-layer-pattern" in argv else GPT
    checked = check(argv, dry_run=True, family=family)
    args, problems = checked.args, checked.problems
    assert not problems, problems
    return args


@pytest.mark.parametrize("case", sorted(CASES))
def test_template_command_line_is_valid(case, tmp_path, monkeypatch):
    variables, world, device = CASES[case]
    argv = dry_run(tmp_path, variables)
    args = checked(argv, world, monkeypatch)
    ckpt = str(tmp_path / "runs" / "tst-job" / "checkpoints")
    assert args.save == args.load == ckpt  # resume where it saved, per job name
    assert args.exit_signal_handler  # SIGTERM -> save after the step -> exit 0
    assert args.sequence_parallel == (args.tensor_model_parallel_size > 1)
    assert args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters == args.train_iters // 10
    gpu_flags = {
        "--bf16",
        "--transformer-impl",
        "--use-distributed-optimizer",
        "--moe-grouped-gemm",
    }
    assert bool(gpu_flags & set(argv)) == (device == "cuda")
    assert ("--num-experts" in argv) == (variables.get("NUM_EXPERTS") != "0")
    assert not (tmp_path / "runs").exists()  # a dry run creates nothing
    pattern = variables.get("HYBRID_LAYER_PATTERN")
    assert ("--num-layers" in argv) == (pattern is None)
    if pattern:  # the pattern sets the layer count: one per symbol
        assert argv[argv.index("--hybrid-layer-pattern") + 1] == pattern
        assert args.num_layers == len(pattern)


def test_extra_args_reach_the_launcher(tmp_path, monkeypatch):
    argv = dry_run(tmp_path, DATA | {"EXTRA_ARGS": "--fp8-format hybrid --fp8-recipe delayed"})
    assert argv[-4:] == ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"]
    assert checked(argv, 16, monkeypatch).fp8 == "hybrid"


@pytest.mark.parametrize(
    "variables,message",
    [
        ({}, "error: set DATA_PATH and TOKENIZER_MODEL (real data), or VOCAB_SIZE for --mock-data"),
        (
            {"DATA_PATH": "/data/corpus_text_document"},
            "error: DATA_PATH is set but TOKENIZER_MODEL is not",
        ),
    ],
)
def test_missing_data_settings_stop_before_srun(variables, message, tmp_path):
    out = run_template(tmp_path, variables)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().startswith(message)


#: A public Megatron-LM line (Llama 3 8B FP8, shrunk to a CPU: tests/e2e/mlm_launch_scripts.py)
#: without --save/--load, as a user would submit it after the template.
def _users_line(tmp_path, *extra) -> list:
    from tests.e2e.mlm_launch_scripts import shrunk

    argv = shrunk("llama3_8b_fp8", {}, str(tmp_path / "mine"))
    for flag in ("--save", "--load"):
        i = argv.index(flag)
        argv = argv[:i] + argv[i + 2 :]
    return ["examples/pretrain_gpt_tst.py", *argv, *extra]


def test_your_own_line_runs_as_it_is_plus_what_preemption_needs(tmp_path, monkeypatch):
    """The arguments after the template: the launcher and its flags, unchanged and in order;
    then --save/--load under the job's folder, --exit-signal-handler (the line has its own
    --save-interval). The template's variables play no part; a dry run creates nothing."""
    line = _users_line(tmp_path)
    out = run_template(tmp_path, {}, check=True, line=line)
    argv = shlex.split(out.stdout)
    assert argv[1] == "examples/pretrain_gpt_tst.py"
    ckpt = str(tmp_path / "runs" / "tst-job" / "checkpoints")
    added = ["--save", ckpt, "--load", ckpt, "--exit-signal-handler"]
    assert argv[2:] == line[1:] + added, argv[2:]
    args = checked(argv[2:], 2, monkeypatch)
    assert args.save == args.load == ckpt and args.exit_signal_handler
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mine").exists()


def test_your_own_save_is_kept_and_read(tmp_path):
    """A line with ``--save=DIR`` (and its own --exit-signal-handler and --save-interval) gets
    only --load DIR; without --save-interval it gets the template's."""
    mine = str(tmp_path / "ckpt")
    line = _users_line(tmp_path, f"--save={mine}", "--exit-signal-handler")
    argv = shlex.split(run_template(tmp_path, {}, check=True, line=line).stdout)
    assert argv[2:] == line[1:] + ["--load", mine]
    i = line.index("--save-interval")
    bare = line[:i] + line[i + 2 :]
    argv = shlex.split(run_template(tmp_path, {}, check=True, line=bare).stdout)
    assert argv[-2:] == ["--save-interval", "1000"]


@pytest.mark.parametrize(
    "line, message",
    [
        (["--num-layers", "2"], "error: the first argument after the template is the launcher"),
        (["examples/no_such.py", "--num-layers", "2"], "error: launcher examples/no_such.py is"),
    ],
)
def test_a_line_without_its_launcher_stops_before_srun(line, message, tmp_path):
    out = run_template(tmp_path, {}, line=line)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().startswith(message), out.stderr


def test_a_setting_is_data_not_shell_code(tmp_path):
    """A setting that would run a command through bash arithmetic is one line naming it, and
    runs nothing; list settings are split at white space without glob expansion."""
    planted = tmp_path / "planted"
    out = run_template(tmp_path, DATA | {"TRAIN_ITERS": f"SEED[$(touch {planted})]"})
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert out.stderr.startswith("error: TRAIN_ITERS='SEED[$(touch "), out.stderr
    assert "is not a whole number" in out.stderr and not planted.exists()
    for name in ("TP", "LR_WSD_DECAY_ITERS", "SAVE_INTERVAL"):
        bad = run_template(tmp_path, DATA | {name: "1+1"})
        assert bad.returncode == 2 and bad.stderr.startswith(f"error: {name}='1+1' is not"), name
    # a glob in EXTRA_ARGS, DATA_PATH or CONTAINER_ARGS stays itself even where files match
    # (the template runs from the repository, where examples/* matches files)
    words = {"EXTRA_ARGS": "--hybrid-layer-pattern M*M* --tokenizer-model examples/*"}
    argv = shlex.split(run_template(tmp_path, DATA | words, check=True).stdout)
    assert argv[-4:] == ["--hybrid-layer-pattern", "M*M*", "--tokenizer-model", "examples/*"]
    blend = {"DATA_PATH": "0.5 /data/a* 0.5 examples/*"}
    argv = shlex.split(run_template(tmp_path, DATA | blend, check=True).stdout)
    i = argv.index("--data-path")
    assert argv[i + 1 : i + 5] == ["0.5", "/data/a*", "0.5", "examples/*"]
