"""Public Megatron-LM (0.19) launch scripts pass the Megatron-LM launcher's ``--dry-run`` at their
own world size, with only the script name changed and ``--tst-bag-size`` added
(:mod:`tests.e2e.mlm_launch_scripts`), on this CPU machine without CUDA or Transformer Engine;
what they get wrong by Megatron-LM's own rules, or TST refuses, is one ``error:`` line."""

import pytest

from tests.e2e import mlm_launch_scripts as scripts
from tests.unit.test_dry_run import _errors, dry

pytest.importorskip("megatron.training")

#: Published parameter counts: ``(reference, tolerance (Megatron-LM prints billions to two
#: decimals), embedding and output parameters to add to the dry run's count)``; the dry run counts no embedding where the vocabulary comes from a
#: tokenizer file (``V x h`` each, untied).
PUBLISHED = {
    # mistralai/Mixtral-8x7B-v0.1: 46,702,792,704 parameters; V = 32000, h = 4096
    "mixtral_8x7b": (46_702_792_704, 0.005e9, 2 * 32_000 * 4096),
    # meta-llama/Meta-Llama-3-8B: 8,030,261,248 parameters (NullTokenizer, V = 128256: counted)
    "llama3_8b_fp8": (8_030_261_248, 0.005e9, 0),
    # Qwen/Qwen3-30B-A3B model card: "Number of Parameters (Non-Embedding): 29.9B"
    "qwen3_30b_a3b": (29.9e9, 0.05e9, 0),
    # DeepSeek-V3 technical report: 671B total parameters (the main model, without the MTP
    # module); V = 129280, h = 7168
    "deepseek_v3_no_mtp": (671e9, 0.5e9, 2 * 129_280 * 7168),
}


def _counted(out: str) -> float:
    """Megatron-LM's total (``Total number of parameters in billions: X``, 2 decimals) that the
    dry run prints."""
    line = next(x for x in out.splitlines() if "Total number of parameters in billions:" in x)
    return float(line.rsplit(":", 1)[1]) * 1e9


def _run(script):
    return dry(script["argv"], env={"WORLD_SIZE": str(script["world_size"]), **script["env"]})


@pytest.mark.parametrize("name", sorted(scripts.SCRIPTS))
def test_public_launch_script_passes_the_dry_run(name):
    script = scripts.SCRIPTS[name]
    result = _run(script)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"layout: world {script['world_size']} = " in out
    assert "TST: bag size 4," in out and "switch at sample" in out
    assert out.rstrip().endswith("dry run: no problems found")
    if name in PUBLISHED:
        reference, tolerance, embedding = PUBLISHED[name]
        assert abs(_counted(out) + embedding - reference) <= tolerance, out


def test_the_batch_size_schedule_is_megatron_lm_s():
    out = _run(scripts.GPT3_175B).stdout
    # "0:16 2.4B:320 ..." in tokens of --seq-length 2048: 2.4e9 / 2048 = 1,171,875 samples
    assert "global batch from sample 0: 16 (16 micro-batches)" in out
    assert "from sample 1,171,875: 320" in out and "from sample 5,859,375: 1536" in out
    # N1 = 0.3 x 500000 = 150000 steps; the samples they consume under the schedule, summed
    # plainly: each step's batch is the schedule's at the samples consumed before it
    schedule = [(0, 16), (1_171_875, 320), (2_343_750, 624), (3_515_625, 928)]
    schedule += [(4_687_500, 1232), (5_859_375, 1536)]
    consumed = 0
    for _ in range(150_000):
        consumed += [batch for threshold, batch in schedule if consumed >= threshold][-1]
    assert f"N1 = 150,000 of 500,000 iterations; switch at sample {consumed:,};" in out


def test_layouts_of_the_scripts():
    gpt3 = _run(scripts.GPT3_175B).stdout
    assert "world 128 = TP 8 x CP 1 x PP 16 x DP 1" in gpt3
    mixtral = _run(scripts.MIXTRAL_8X7B).stdout
    assert "world 32 = TP 1 x CP 1 x PP 4 x DP 8; VPP 1; EP 8, ETP 1, expert DP 1" in mixtral
    assert "global batch 256 = micro-batch 1 x DP 8 x 32 micro-batches per step" in mixtral
    oss = _run(scripts.GPT_OSS).stdout
    assert "softmax learnable, window (127, 0)" in oss and "world 4 = TP 1 x CP 1 x PP 4" in oss


@pytest.mark.parametrize(
    "name,message",
    [
        (
            "GPT3_175B_AS_PUBLISHED",
            "error: Megatron-LM's argument validation: Cannot specify both "
            "--step-batch-size-schedule and --global-batch-size",
        ),
        (
            "QWEN3_30B_A3B_AS_PUBLISHED",
            "error: Megatron-LM's argument validation: Transformer Engine cross entropy loss "
            "fusion is disabled due to stability issues. Use --cross-entropy-fusion-impl "
            "native, or omit --cross-entropy-loss-fusion.",
        ),
        (
            "QWEN3_235B_A22B_H100_AS_PUBLISHED",
            "error: Megatron-LM's argument validation: Transformer Engine cross entropy loss "
            "fusion is disabled due to stability issues. Use --cross-entropy-fusion-impl "
            "native, or omit --cross-entropy-loss-fusion.",
        ),
        (
            "GPT_OSS_AS_PUBLISHED",
            "error: Megatron-LM's argument parser: unrecognized arguments: "
            "--export-force-local-attention --enable-gpt-oss",
        ),
    ],
)
def test_what_megatron_lm_itself_refuses_in_a_published_script_is_one_line(name, message):
    result = _run(getattr(scripts, name))
    assert result.returncode == 2
    assert _errors(result.stderr) == [message]
    assert "Traceback" not in result.stderr


def test_deepseek_v3_as_published_passes_unchanged():
    """DeepSeek-V3 as published: MTP (trained in phase 2 only; its skipped block still waits
    for its parameters' all-gather) with the distributed optimizer and
    ``--overlap-param-gather`` (2-process CPU exactness: tests/distributed/
    test_distributed_optimizer.py)."""
    result = _run(scripts.DEEPSEEK_V3)
    assert result.returncode == 0, result.stderr
    assert "MTP 1 layer(s)" in result.stdout


@pytest.mark.parametrize("name", sorted(scripts.HYBRID_SCRIPTS))
def test_public_hybrid_launch_line_passes_the_hybrid_dry_run(name):
    """``pretrain_hybrid.py`` lines pass ``examples/pretrain_hybrid_tst.py --dry-run`` at their
    world size; the GPT launcher refuses them in one line naming the hybrid launcher; on a CPU
    their Mamba-2 layers are one line naming mamba_ssm."""
    script = scripts.HYBRID_SCRIPTS[name]
    env = {"WORLD_SIZE": str(script["world_size"]), **script["env"]}
    result = dry(script["argv"], env=env, model="hybrid")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    pattern = script["argv"][script["argv"].index("--hybrid-layer-pattern") + 1]
    counts = {s: pattern.count(s) for s in "M*-E"}
    assert (
        f"model: HybridModel '{pattern}': {counts['M']} Mamba-2 (M), {counts['*']} attention" in out
    )
    assert "TST: bag size 4," in out and out.rstrip().endswith("dry run: no problems found")
    gpt = dry(script["argv"], env=env)
    errors = _errors(gpt.stderr)
    assert gpt.returncode == 2 and len(errors) == 1, gpt.stderr
    assert "--hybrid-layer-pattern" in errors[0] and "examples/pretrain_hybrid_tst.py" in errors[0]
    cpu = dry(script["argv"] + ["--device", "cpu"], env=env, model="hybrid")
    assert [e for e in _errors(cpu.stderr) if "Mamba-2 layers (M) need the mamba_ssm package" in e]


def test_the_nemotron_line_keeps_its_moe_settings():
    out = _run_hybrid(scripts.NEMOTRON3_NANO).stdout
    assert "world 32 = TP 4 x CP 1 x PP 1 x DP 8; VPP 1; EP 8, ETP 4" in out
    assert "128 experts of 1856, top-6, shared expert 3712" in out


def _run_hybrid(script):
    env = {"WORLD_SIZE": str(script["world_size"]), **script["env"]}
    return dry(script["argv"], env=env, model="hybrid")


@pytest.mark.parametrize("name", ["QWEN3_235B_A22B_H100", "DEEPSEEK_V3_H100"])
def test_modelzoo_large_moe_h100_lines_pass_with_the_all_to_all_overlap(name):
    """Megatron-MoE-ModelZoo's H100 best practice for Qwen3-235B-A22B (256 ranks) and
    DeepSeek-V3 (1024 ranks, MTP, FP8): the expert-parallel all-to-all overlap with
    ``--delay-wgrad-compute``, the flex (DeepEP) dispatcher, PP 8 with virtual stages, at
    ``CUDA_DEVICE_MAX_CONNECTIONS=32``; the Qwen3 line with the one change Megatron-LM 0.19
    itself asks for (the cross-entropy fusion, above)."""
    script = getattr(scripts, name)
    assert "--overlap-moe-expert-parallel-comm" in script["argv"]
    assert "--delay-wgrad-compute" in script["argv"]
    result = _run(script)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.rstrip().endswith("dry run: no problems found")
    if name == "QWEN3_235B_A22B_H100":
        assert "world 256 = TP 2 x CP 1 x PP 8 x DP 16; VPP 4; EP 32" in out
        # Qwen/Qwen3-235B-A22B model card: 235B total; V = 151,936, h = 4096 (untied)
        assert abs(_counted(out) + 2 * 151_936 * 4096 - 235e9) <= 0.5e9, out
    else:
        assert "world 1024 = TP 2 x CP 1 x PP 8 x DP 64; VPP 4; EP 64" in out
        assert "MTP 1 layer(s)" in out


def test_the_nemotron_3_super_gb200_line_passes_with_its_gpu_named():
    """NVIDIA's Nemotron 3 Super GB200 release line (``CUDA_DEVICE_MAX_CONNECTIONS=32`` with TP 2,
    Blackwell's rule; MXFP8, TE CUDA graphs, the hybridep dispatcher, 2 MTP layers) passes the
    hybrid dry run unchanged with ``--dry-run-gpu GB200``; as for the default H100 it is
    Megatron-LM's own Hopper rule, in one line."""
    script = scripts.NEMOTRON3_SUPER_GB200
    env = {"WORLD_SIZE": str(script["world_size"]), **script["env"]}
    result = dry(script["argv"] + ["--dry-run-gpu", script["gpu"]], env=env, model="hybrid")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "assumed: --dry-run-gpu: validated as for the GB200 (compute capability 10.0)" in out
    assert "world 64 = TP 2 x CP 1 x PP 1 x DP 32; VPP 1; EP 64, ETP 1" in out
    assert "40 Mamba-2 (M), 8 attention (*), 40 MoE (E); MTP 2 x '*E'" in out
    assert "512 experts of 2688, top-22, shared expert 5376" in out
    assert out.rstrip().endswith("dry run: no problems found")
    as_h100 = dry(script["argv"], env=env, model="hybrid")
    assert as_h100.returncode == 2
    assert _errors(as_h100.stderr) == [
        "error: Megatron-LM's argument validation: Using tensor model parallelism or context "
        "parallelism require setting the environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1"
    ]
