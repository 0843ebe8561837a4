"""Hugging Face conversion: a TST-trained checkpoint is an ordinary model.

Tiny MoE models are trained by the trainer on 2 gloo processes (PP=2 with virtual stages,
TP=2+SP, EP=2), through
the TST switch, exported with ``tools/convert_checkpoint.py``, and loaded with
``transformers``. References: megatron-core's own ``GPTModel`` forward (logits, greedy
decoding) and the checkpoint read with stock ``torch.distributed.checkpoint`` (weights).
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.defaults import TEST_DEFAULTS
from tests.distributed.harness import run_distributed

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N, N1, V = 4, 2, 120  # 4 steps, switch at 2; vocabulary 120 padded to 128

MODEL = [
    *TEST_DEFAULTS,
    "--mock-data",
    "--vocab-size",
    str(V),
    "--make-vocab-size-divisible-by",
    "64",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--kv-channels",
    "16",
    "--ffn-hidden-size",
    "64",
    "--seq-length",
    "16",
    "--swiglu",
    "--disable-bias-linear",
    "--num-experts",
    "4",
    "--moe-ffn-hidden-size",
    "24",
    "--moe-router-topk",
    "2",
    "--norm-epsilon",
    "1e-6",
    "--rotary-base",
    "500000",
]
TRAIN = [
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    str(N),
    "--tst-bag-size",
    "2",
    "--tst-phase1-iters",
    str(N1),
    "--lr",
    "1e-2",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--device",
    "cpu",
    "--seed",
    "3",
    "--log-interval",
    "1",
]
CASES = {
    # name: (architecture flags, layout flags)
    "qwen3_moe-untied-vpp": (
        ["--qk-layernorm", "--untie-embeddings-and-output-weights", "--num-layers", "4"],
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    ),
    "qwen3_moe-tied-ep2": (["--qk-layernorm"], ["--expert-model-parallel-size", "2"]),
    "mixtral-untied-tp2": (
        ["--untie-embeddings-and-output-weights"],
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ),
    "mixtral-tied-ep2": ([], ["--expert-model-parallel-size", "2"]),
}


def _train_child(rank, world, *, argv):
    from tst_megatron.training import trainer
    from tst_megatron.training.config import parse_args

    return trainer.train(parse_args(argv))


def _convert(*argv, expect=0):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), *map(str, argv)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == expect, proc.stdout + proc.stderr
    return proc


def _megatron_child(rank, world, *, jobs, tokens=None, prompt=None):
    """For each ``{name: checkpoint dir}``: logits of megatron-core's GPTModel on ``tokens``
    and its greedy decoding of 16 tokens after ``prompt`` (full forward per step)."""
    from megatron.core import dist_checkpointing

    from tst_megatron.conversion.megatron import build_model, single_process
    from tst_megatron.training.checkpointing import load_model_weights

    tokens = TOKENS if tokens is None else tokens
    prompt = PROMPT if prompt is None else prompt
    results = {}
    for name, path in jobs.items():
        args = dist_checkpointing.load_common_state_dict(path)["args"]
        vocab = args["model"]["vocab_size"]
        with single_process():
            model = build_model(args)
            load_model_weights(path, [model])

            def logits_of(ids):
                positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
                with torch.no_grad():
                    return model(ids, positions, None)[..., :vocab].double()

            ids = prompt
            for _ in range(16):
                ids = torch.cat([ids, logits_of(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
            results[name] = {"logits": logits_of(tokens), "greedy": ids}
    return results


def _hf_model(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def _dcp_plain(path):
    """The checkpoint's tensors read with stock torch.distributed.checkpoint (no megatron-core)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state = {}
    _load_state_dict(
        state,
        storage_reader=FileSystemReader(path),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _export_child(rank, world, *, jobs):
    """Export several checkpoints in one process (the CLI is exercised elsewhere)."""
    from tst_megatron.conversion import export_checkpoint

    return [export_checkpoint(load, out, ckpt_step=step) for load, out, step in jobs]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Each case trained for N steps on 2 processes (switch checkpoint at N1), then exported."""
    out = {}
    for name, (arch, layout) in CASES.items():
        root = tmp_path_factory.mktemp(name)
        ranks = run_distributed(
            _train_child, 2, argv=MODEL + arch + layout + TRAIN + ["--save", str(root / "ckpt")]
        )
        assert ranks[0]["exit"] == "finished"
        out[name] = root
    run_distributed(
        _export_child, 1, jobs=[(str(r / "ckpt"), str(r / "hf"), None) for r in out.values()]
    )
    return out


@pytest.fixture(scope="module")
def megatron_outputs(trained):
    """Logits on TOKENS and 16 greedy steps from PROMPT, by megatron-core, for every case."""
    (results,) = run_distributed(
        _megatron_child,
        1,
        jobs={name: str(root / "ckpt" / f"iter_{N:07d}") for name, root in trained.items()},
    )
    return results


TOKENS = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
PROMPT = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", list(CASES))
def test_export_logits_match_megatron(trained, megatron_outputs, name):
    root = trained[name]
    config = json.load(open(root / "hf" / "config.json"))
    expected = "Qwen3MoeForCausalLM" if name.startswith("qwen3") else "MixtralForCausalLM"
    assert config["architectures"] == [expected]
    assert config["tie_word_embeddings"] == ("-tied" in name)
    with torch.no_grad():
        theirs = _hf_model(root / "hf")(TOKENS).logits.double()
    assert theirs.shape == (2, 16, V)
    assert (theirs - megatron_outputs[name]["logits"]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["qwen3_moe-untied-vpp", "mixtral-tied-ep2"])
def test_exported_weights_are_the_checkpoint_tensors(trained, name):
    """Stock-PyTorch read of the torch_dist files vs the safetensors, mapped by hand here."""
    from safetensors.torch import load_file

    root = trained[name]
    plain = _dcp_plain(str(root / "ckpt" / f"iter_{N:07d}"))
    hf = load_file(str(root / "hf" / "model.safetensors"))
    torch.testing.assert_close(
        hf["model.embed_tokens.weight"],
        plain["embedding.word_embeddings.weight"][:V],
        rtol=0,
        atol=0,
    )
    if "untied" in name:
        torch.testing.assert_close(
            hf["lm_head.weight"], plain["output_layer.weight"][:V], rtol=0, atol=0
        )
    else:
        assert "lm_head.weight" not in hf
    moe = "mlp" if name.startswith("qwen3") else "block_sparse_moe"
    gate, up = ("gate_proj", "up_proj") if moe == "mlp" else ("w1", "w3")
    fc1 = plain["decoder.layers.mlp.experts.experts.linear_fc1.weight"]  # [layers, experts, 2I, h]
    qkv = plain["decoder.layers.self_attention.linear_qkv.weight"]  # [layers, G*(Q/G+2)*d, h]
    for layer in range(2):
        torch.testing.assert_close(
            hf[f"model.layers.{layer}.{moe}.gate.weight"],
            plain["decoder.layers.mlp.router.weight"][layer],
            rtol=0,
            atol=0,
        )
        for e in range(4):
            prefix = f"model.layers.{layer}.{moe}.experts.{e}."
            torch.testing.assert_close(
                hf[prefix + gate + ".weight"], fc1[layer, e, :24], rtol=0, atol=0
            )
            torch.testing.assert_close(
                hf[prefix + up + ".weight"], fc1[layer, e, 24:], rtol=0, atol=0
            )
        # group 1 of 2 holds query heads 2, 3 then k_1, v_1 (16 rows each)
        rows = qkv[layer, 4 * 16 : 8 * 16]
        q = hf[f"model.layers.{layer}.self_attn.q_proj.weight"]
        torch.testing.assert_close(q[2 * 16 : 4 * 16], rows[:32], rtol=0, atol=0)
        torch.testing.assert_close(
            hf[f"model.layers.{layer}.self_attn.k_proj.weight"][16:], rows[32:48], rtol=0, atol=0
        )
        torch.testing.assert_close(
            hf[f"model.layers.{layer}.self_attn.v_proj.weight"][16:], rows[48:], rtol=0, atol=0
        )


@pytest.mark.parametrize("name", ["qwen3_moe-untied-vpp", "mixtral-tied-ep2"])
def test_greedy_generation_matches_megatron(trained, megatron_outputs, name):
    root = trained[name]
    model = _hf_model(root / "hf")
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = model.generate(PROMPT, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert theirs.shape == (1, 21)
    assert theirs.tolist() == megatron_outputs[name]["greedy"].tolist()


def test_switch_checkpoint_exports_like_a_baseline_one(trained, tmp_path):
    """The TST checkpoint at the switch exports to the same names, shapes and config as a
    baseline (bag size 1) run's, and its logits match too."""
    from safetensors.torch import load_file

    name = "qwen3_moe-untied-vpp"
    arch, layout = CASES[name]
    root = trained[name]
    _convert("export", "--load", root / "ckpt", "--ckpt-step", N1, "--save", tmp_path / "switch")
    before = {p: os.path.getmtime(tmp_path / "switch" / p) for p in os.listdir(tmp_path / "switch")}
    refused = _convert("export", "--load", root / "ckpt", "--save", tmp_path / "switch", expect=2)
    assert (
        refused.stderr.strip().splitlines()[-1]
        == f"error: {tmp_path / 'switch'} exists; pass --force to replace it"
    )
    assert before == {
        p: os.path.getmtime(tmp_path / "switch" / p) for p in os.listdir(tmp_path / "switch")
    }
    base_train = [
        a if a != "2" or i == 0 or TRAIN[i - 1] != "--tst-bag-size" else "1"
        for i, a in enumerate(TRAIN)
    ]
    run_distributed(
        _train_child,
        2,
        argv=MODEL
        + arch
        + layout
        + base_train
        + ["--save", str(tmp_path / "base"), "--save-interval", str(N1)],
    )
    run_distributed(_export_child, 1, jobs=[(str(tmp_path / "base"), str(tmp_path / "basehf"), N1)])
    switch = load_file(str(tmp_path / "switch" / "model.safetensors"))
    base = load_file(str(tmp_path / "basehf" / "model.safetensors"))
    assert {k: v.shape for k, v in switch.items()} == {k: v.shape for k, v in base.items()}
    assert json.load(open(tmp_path / "switch" / "config.json")) == json.load(
        open(tmp_path / "basehf" / "config.json")
    )
    (ours,) = run_distributed(
        _megatron_child, 1, jobs={"switch": str(root / "ckpt" / f"iter_{N1:07d}")}
    )
    with torch.no_grad():
        theirs = _hf_model(tmp_path / "switch")(TOKENS).logits.double()
    assert (theirs - ours["switch"]["logits"]).abs().max().item() <= 1e-4


# --- Hugging Face -> Megatron -> Hugging Face -------------------------------------------------

HF_MODELS = {
    # model_type: (config kwargs, the layouts the Megatron checkpoint is resharded through)
    "qwen3_moe": (
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            intermediate_size=40,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            num_hidden_layers=2,
        ),
        ("ep2", "etp2"),
    ),
    "mixtral": (
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24, num_hidden_layers=2),
        ("tp2",),
    ),
    "qwen3": (dict(intermediate_size=40, num_hidden_layers=2, tie_word_embeddings=True), ("tp2",)),
    "llama": (dict(intermediate_size=40, num_hidden_layers=2), ("pp2",)),
}


def _make_hf(path, model_type, kwargs, dtype):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        model_type,
        vocab_size=V,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        **kwargs,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():  # make every weight (norms, routers too) distinct and non-trivial
        for p in model.parameters():
            p.normal_(0, 0.5)
    model.save_pretrained(path)


def _reshard_child(rank, world, *, src, dst, layout):
    """Load a release checkpoint into a 2-process layout and save it again from there."""
    from megatron.core import dist_checkpointing

    from tst_megatron.conversion.megatron import read_args, run_config
    from tst_megatron.runtime import initialize_model_parallel
    from tst_megatron.runtime.distributed import ParallelConfig
    from tst_megatron.training import checkpointing
    from tst_megatron.training.config import ParallelArgs, TrainArgs
    from tst_megatron.training.model import build_gpt_model, transformer_config

    saved = dist_checkpointing.load_common_state_dict(os.path.join(src, "release"))["args"]
    args = read_args(os.path.join(src, "release"))  # the converter's dict of Megatron-LM's args
    sizes = {
        "tp2": dict(tensor_model_parallel_size=2),
        "pp2": dict(pipeline_model_parallel_size=2),
        "ep2": dict(expert_model_parallel_size=2),
        "etp2": dict(expert_tensor_parallel_size=2),
    }[layout]
    initialize_model_parallel(ParallelConfig(**sizes))
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(0)
    cfg = dataclasses.replace(
        run_config(args),
        parallel=ParallelArgs(**sizes),
        train=TrainArgs(device="cpu", sequence_parallel=layout == "tp2"),
    )
    config = transformer_config(cfg, use_cpu_initialization=True)
    model = build_gpt_model(
        config,
        vocab_size=args["padded_vocab_size"],
        max_sequence_length=64,
        share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    checkpointing.load_model_weights(os.path.join(src, "release"), [model])
    checkpointing.save_release(dst, [model], args=saved)
    return sum(p.numel() for p in model.parameters())


def _import_child(rank, world, *, jobs):
    from tst_megatron.conversion import import_checkpoint

    return [
        import_checkpoint(src, dst, make_vocab_size_divisible_by=64, tensor_model_parallel_size=2)[
            "flags"
        ]
        for src, dst in jobs
    ]


def _reshard_all_child(rank, world, *, jobs):
    return [_reshard_child(rank, world, **job) for job in jobs]


def test_round_trip_hf_megatron_hf_is_bit_identical(tmp_path):
    """Each architecture (Qwen3-MoE in bf16 with a dense layer, the rest fp32): HF -> release
    checkpoint -> loaded and re-saved by 2 processes in another layout -> HF, bit for bit."""
    from safetensors.torch import load_file

    for model_type, (kwargs, _) in HF_MODELS.items():
        dtype = torch.bfloat16 if model_type == "qwen3_moe" else torch.float32
        _make_hf(tmp_path / model_type / "hf", model_type, kwargs, dtype)
    run_distributed(
        _import_child,
        1,
        jobs=[(str(tmp_path / t / "hf"), str(tmp_path / t / "m1")) for t in HF_MODELS],
    )
    jobs, last = [], {}
    for t, (_, layouts) in HF_MODELS.items():
        for i, layout in enumerate(layouts):
            jobs.append(
                dict(
                    src=str(tmp_path / t / f"m{i + 1}"),
                    dst=str(tmp_path / t / f"m{i + 2}"),
                    layout=layout,
                )
            )
        last[t] = str(tmp_path / t / f"m{len(layouts) + 1}")
    (held, _) = run_distributed(_reshard_all_child, 2, jobs=jobs)
    run_distributed(
        _export_child, 1, jobs=[(last[t], str(tmp_path / t / "hf2"), None) for t in HF_MODELS]
    )
    held = iter(held)
    for model_type, (kwargs, layouts) in HF_MODELS.items():
        rank_params = min(next(held) for _ in layouts)
        before = load_file(str(tmp_path / model_type / "hf" / "model.safetensors"))
        after = load_file(str(tmp_path / model_type / "hf2" / "model.safetensors"))
        assert rank_params < sum(t.numel() for t in before.values()), layouts  # really split
        if kwargs.get("tie_word_embeddings") and "lm_head.weight" in before:
            del before["lm_head.weight"]  # a tied model's output weight is stored once
        assert sorted(before) == sorted(after), model_type
        for name in before:
            assert before[name].dtype == after[name].dtype, name
            assert torch.equal(before[name], after[name]), name
        c1 = json.load(open(tmp_path / model_type / "hf" / "config.json"))
        c2 = json.load(open(tmp_path / model_type / "hf2" / "config.json"))
        for key in (
            "architectures",
            "num_hidden_layers",
            "hidden_size",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "tie_word_embeddings",
            "vocab_size",
            "dtype",
            "mlp_only_layers",
            "norm_topk_prob",
            "intermediate_size",
            "moe_intermediate_size",
            "rope_parameters",
        ):
            assert c1.get(key) == c2.get(key), (model_type, key)


def test_imported_checkpoint_trains_with_the_printed_flags(tmp_path):
    """An imported Mixtral continues pretraining on 2 processes (EP=2) from --load (into the
    same directory, as Megatron users do) with the flags the import prints."""
    kwargs, _ = HF_MODELS["mixtral"]
    _make_hf(tmp_path / "hf", "mixtral", kwargs, torch.float32)
    proc = _convert(
        "import",
        "--load",
        tmp_path / "hf",
        "--save",
        tmp_path / "ckpt",
        "--make-vocab-size-divisible-by",
        "64",
    )
    flags = proc.stdout.split("train from it with: ")[1].splitlines()[0].split()
    argv = flags + [
        "--mock-data",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--train-iters",
        "2",
        "--lr",
        "1e-4",
        "--device",
        "cpu",
        "--expert-model-parallel-size",
        "2",
        "--log-interval",
        "1",
        "--tst-bag-size",
        "2",
        "--tst-phase1-iters",
        "1",
    ]
    ranks = run_distributed(_train_child, 2, argv=argv + ["--save", str(tmp_path / "ckpt")])
    assert ranks[0]["exit"] == "finished"
    assert all(torch.isfinite(torch.tensor(v)) for v in ranks[0]["train"].values())
    # the run started from the imported weights: 2 small steps later they are close to them
    # (a fresh initialisation would be ~0.5 away: the HF weights are drawn with std 0.5)
    start = _dcp_plain(str(tmp_path / "ckpt" / "release"))
    end = _dcp_plain(str(tmp_path / "ckpt" / "iter_0000002"))
    for key in ("embedding.word_embeddings.weight", "decoder.layers.mlp.router.weight"):
        change = (end[key] - start[key]).abs().max().item()
        assert 0 < change < 1e-2, key
