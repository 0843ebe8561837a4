"""The GPU recipes of the paper's smallest row (benchmarks/recipes.py) are launch lines the
launcher (examples/pretrain_gpt_tst.py, Megatron-LM's pretrain()) accepts for CUDA at their
world size (its --dry-run), and their cost estimate is what the docs say."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from recipes import RECIPES, estimate  # noqa: E402
from study.definitions import lr_flags, tst_flags  # noqa: E402
from tst_vs_baseline import parse  # noqa: E402

from tst_megatron.loop.plan import run_plan  # noqa: E402
from tst_megatron.models.family import HYBRID  # noqa: E402
from tst_megatron.training.validate import check  # noqa: E402


def _arms(recipe):
    shared = recipe.flags(
        data_path="/data/corpus_text_document",
        tokenizer_model="/data/tok.model",
        tokenizer_type="SentencePieceTokenizer",
        data_cache_path="/tmp/cache",
    )
    base = shared + lr_flags(recipe.lr) + ["--tst-bag-size", "1"]
    tst = shared + lr_flags(recipe.lr) + tst_flags(recipe.bag_size, recipe.phase1_fraction, "full")
    return {"baseline": base, "tst": tst}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_passes_the_launchers_checks_for_cuda(name, monkeypatch):
    # Megatron-LM's validate_args + TransformerConfig + the TST checks, at the recipe's world
    # size, as a CUDA run (the launch line has --device cuda)
    recipe = RECIPES[name]
    monkeypatch.setenv("WORLD_SIZE", str(recipe.nodes * recipe.gpus_per_node))
    for arm, flags in _arms(recipe).items():
        checked = check(flags, dry_run=True)
        args, problems = checked.args, checked.problems
        assert problems == [], (arm, problems)
        assert args.lr == 2e-3 and args.lr_warmup_iters == recipe.lr_warmup_iters
        assert args.untie_embeddings_and_output_weights and args.bf16
        assert args.data_parallel_size == recipe.nodes * recipe.gpus_per_node
        assert args.lr_wsd_decay_iters == recipe.train_iters // 10  # WSD: the last 10 %
        assert args.tst_bag_size == (1 if arm == "baseline" else recipe.bag_size)
        assert (args.transformer_impl == "local") == recipe.local_spec
        n1 = checked.plan.n1
        assert run_plan(args) == checked.plan
        assert n1 == (0 if arm == "baseline" else round(0.3 * recipe.train_iters))


def test_a_broken_recipe_is_caught(monkeypatch):
    # the check above can fail: 9 heads do not split over TP = 2
    recipe = RECIPES["smollm2-135m-small"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron-LM asks for it with TP
    flags = _arms(recipe)["tst"] + ["--tensor-model-parallel-size", "2"]
    problems = check(flags, dry_run=True).problems
    assert problems and any("attention" in p or "heads" in p for p in problems), problems


def test_paper_row_settings_and_cost():
    big, small = RECIPES["smollm2-135m"], RECIPES["smollm2-135m-small"]
    # SmolLM2-135M (tied) has 134,515,008 parameters (its Hugging Face card); untied adds V x h
    assert big.parameters()["total"] - 49152 * 576 == 134_515_008
    e = estimate(big)
    assert e["tokens_per_step"] == 1024 * 2048 and big.train_iters == 20000
    # 6N + 6LTh FLOPs/token, 2 arms, 30 % of 989 TFLOP/s, written out by hand
    per_token = 6 * 134_515_008 + 6 * 30 * 2048 * 576
    hours = per_token * 1024 * 2048 * 20000 * 2 / (0.3 * 989e12) / 3600
    assert e["gpu_hours"] == pytest.approx(hours) and 70 < hours < 90
    # the one-GPU variant: both arms under an hour even at 20 % MFU
    assert estimate(small, mfu=0.2)["gpu_hours"] < 1.0 and small.gpus_per_node == 1


def test_benchmark_accepts_presets_and_refuses_cpu():
    args = parse(
        [
            "--preset",
            "smollm2-135m-small",
            "--device",
            "cuda",
            "--data-path",
            "d",
            "--tokenizer-model",
            "t",
        ]
    )
    assert (args.bag_size, args.phase1_fraction, args.lrs_list) == (6, 0.3, [2e-3])
    assert args.nproc_per_node == 1 and args.train_iters == 2000
    with pytest.raises(SystemExit):
        parse(["--preset", "smollm2-135m", "--data-path", "d", "--tokenizer-model", "t"])


def test_sbatch_template_parses():
    script = os.path.join(ROOT, "slurm", "tst_vs_baseline_gpu.sbatch")
    result = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_passes_the_launchers_dry_run(name):
    recipe = RECIPES[name]
    flags = _arms(recipe)["tst"]
    env = dict(
        os.environ,
        WORLD_SIZE=str(recipe.nodes * recipe.gpus_per_node),
        PYTHONWARNINGS="ignore",
        PYTHONPATH=ROOT,
    )
    result = subprocess.run(
        [sys.executable, "examples/pretrain_gpt_tst.py", "--dry-run", *flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "no problems found" in result.stdout
    # the dry run reads no tokenizer: Megatron-LM's count there is without the embeddings,
    # which must be the recipe's own arithmetic (recipes.Recipe.parameters), in billions
    line = next(x for x in result.stdout.splitlines() if "Total number of parameters" in x)
    assert abs(float(line.rsplit(":", 1)[1]) - recipe.parameters()["non_embedding"] / 1e9) < 0.006


def _hybrid_recipe() -> list:
    """The launcher flags of docs/gpu_recipe.md's hybrid command (after its marker)."""
    import re
    import shlex

    text = open(os.path.join(ROOT, "docs", "gpu_recipe.md")).read()
    block = re.search(r"<!-- hybrid-recipe -->\n```bash\n(.*?)```", text, re.S).group(1)
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[:3] == ["torchrun", "--nproc-per-node", "1"]
    assert argv[3] == "examples/pretrain_hybrid_tst.py"
    return argv[4:]


def test_the_hybrid_recipe_passes_the_hybrid_launchers_checks_for_cuda(monkeypatch):
    # the Mamba-2 hybrid of docs/gpu_recipe.md: Megatron-LM's validation, its TransformerConfig
    # and the TST and hybrid rules, as a CUDA run on 1 GPU (the dry run assumes the kernels'
    # packages; a real launch without mamba_ssm stops in one line)
    monkeypatch.setenv("WORLD_SIZE", "1")
    flags = _hybrid_recipe()
    checked = check(flags, dry_run=True, family=HYBRID)
    assert checked.problems == [], checked.problems
    args = checked.args
    assert args.hybrid_layer_pattern.count("M") == 12 and args.num_layers == 32
    assert args.tst_bag_size == 6 and checked.plan.n1 == 600
    baseline = flags[: flags.index("--tst-bag-size") + 1] + ["1"]
    baseline += flags[flags.index("--tst-bag-size") + 2 :]
    assert check(baseline, dry_run=True, family=HYBRID).problems == []


def test_the_gpu_study_script_runs_the_h200_recipe():
    """``scripts/gpu_study.sh`` (issue 55) parses and runs a recipe that exists: ~98M tokens
    per arm on real text at T 1024 with a vocabulary of 32,000 (the carried tokenizer's),
    on one GPU, with the local spec (the lent H200 has no Transformer Engine)."""
    script = os.path.join(ROOT, "scripts", "gpu_study.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0 and os.access(script, os.X_OK)
    text = open(script).read()
    assert "--preset h200-study-dense" in text and "--reuse" in text
    recipe = RECIPES["h200-study-dense"]
    assert recipe.local_spec and recipe.gpus_per_node * recipe.nodes == 1
    tokens = recipe.global_batch_size * recipe.seq_length * recipe.train_iters
    assert tokens >= 50e6 and recipe.seq_length >= 1024
    import sentencepiece

    carried = os.path.join(ROOT, "benchmarks", "data", "code32k.model")
    vocab = sentencepiece.SentencePieceProcessor(model_file=carried).vocab_size()
    assert vocab == recipe.vocab_size >= 16_000


def test_the_gpu_study_rehearsal_is_the_preset_tiny_on_a_cpu(monkeypatch):
    """``--rehearse`` (``scripts/gpu_study.sh`` with ``REHEARSE=1``): the h200 preset's flags at
    a tiny size on a CPU (no bf16, the launcher's CPU flags), passing the launcher's checks at
    its 2 processes; without ``--rehearse`` a preset on the CPU is refused."""
    recipe = RECIPES["h200-study-dense"]
    tiny = recipe.rehearsal()
    assert tiny.device == "cpu" and tiny.name == "h200-study-dense-rehearsal"
    assert (tiny.vocab_size, tiny.bag_size, tiny.phase1_fraction, tiny.lr) == (
        recipe.vocab_size,
        recipe.bag_size,
        recipe.phase1_fraction,
        recipe.lr,
    )
    monkeypatch.setenv("WORLD_SIZE", str(tiny.gpus_per_node))
    for arm, flags in _arms(tiny).items():
        assert flags[:2] == ["--device", "cpu"] and "--bf16" not in flags
        checked = check(flags, dry_run=True)
        assert checked.problems == [], (arm, checked.problems)
        assert checked.args.seq_length == 128 and checked.args.train_iters == 24
    study = ["--preset", "h200-study-dense", "--data-path", "d", "--tokenizer-model", "t"]
    args = parse(study + ["--device", "cpu", "--rehearse"])
    assert args.preset == "h200-study-dense-rehearsal" and args.nproc_per_node == 2
    assert args.train_iters == 24 and "h200-study-dense-rehearsal" not in RECIPES
    with pytest.raises(SystemExit):
        parse(study + ["--device", "cpu"])
    with pytest.raises(SystemExit):
        parse(study + ["--device", "cuda", "--rehearse"])
    text = open(os.path.join(ROOT, "scripts", "gpu_study.sh")).read()
    assert "--rehearse" in text and "runs/gpu_study_rehearsal" in text
