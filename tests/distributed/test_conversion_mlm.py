"""Hugging Face conversion of checkpoints written by Megatron-LM's own loop.

Tiny models are trained through the TST switch by the launcher on
``megatron.training.pretrain()`` (:func:`tst_megatron.training.cli.main`) on 2 gloo
processes (a Llama-style dense model with TP=2 + SP, a Mixtral-style MoE with EP=2, a
Qwen3-MoE with dense and MoE layers, untied, with PP=2 and virtual stages), so the
checkpoints are Megatron-LM's own (its ``args`` namespace, tracker file, optimizer state).
They are exported to Hugging Face and imported back; the imported ``release`` is loaded by
the launcher's ``--load`` (Megatron-LM's ``load_checkpoint``) into a 2-process layout, and an
imported Hugging Face Mixtral trains from it with the flags the import prints. Hugging Face
models of each architecture go HF -> Megatron -> HF bit for bit, their release resharded
through 2-process layouts on the way.

References, written here: megatron-core's ``GPTModel`` built from the checkpoint's saved
``args`` with Megatron-LM's ``core_transformer_config_from_args`` and megatron-core's local
block spec (not the converter's model builder): its logits and greedy decoding; the
checkpoint's tensors read with stock ``torch.distributed.checkpoint``, mapped by hand.
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch

pytest.importorskip("megatron.training")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.distributed.harness import one_process_args, run_distributed  # noqa: E402
from tests.launcher import losses as _losses  # noqa: E402
from tests.launcher import pretrain_child as _launcher_child  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H, I_MOE = 32, 24  # hidden size, expert FFN width
QWEN = "qwen3_moe-untied-vpp"
#: Vocabulary per case: 120 rows padded to 128 (the export drops the padding, the import
#: zero-fills it), and 128 with no padding (the launcher's loss covers the padded rows too).
VOCAB = {"llama-untied-tp2": 120, "mixtral-tied-ep2": 128, QWEN: 120}

MODEL = [
    "--tokenizer-type", "NullTokenizer", "--make-vocab-size-divisible-by", "64",
    "--num-layers", "2", "--hidden-size", str(H), "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
    "--ffn-hidden-size", "64", "--seq-length", "16", "--max-position-embeddings", "16",
    "--position-embedding-type", "rope", "--rotary-base", "500000",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
    "--swiglu", "--disable-bias-linear",
]  # fmt: skip
RUN = [
    "--device", "cpu", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr", "1e-2", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1",
    "--num-workers", "0", "--seed", "3",
    "--tst-bag-size", "2", "--tst-phase1-iters", "2", "--train-iters", "3",
]  # fmt: skip
SAVE = ["--save-interval", "3", "--ckpt-format", "torch_dist"]
CASES = {
    # name: (architecture flags, layout flags of the 2-process run that saves)
    "llama-untied-tp2": (
        ["--untie-embeddings-and-output-weights"],
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ),
    "mixtral-tied-ep2": (
        [
            "--num-experts", "4", "--moe-ffn-hidden-size", str(I_MOE), "--moe-router-topk", "2",
            "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "1e-2",
        ],
        ["--expert-model-parallel-size", "2"],
    ),
    # layers 0, 2 MoE, 1, 3 dense; each pipeline rank holds two virtual stages of one layer;
    # also saved at the switch (iteration 2)
    QWEN: (
        [
            "--num-layers", "4", "--qk-layernorm", "--untie-embeddings-and-output-weights",
            "--num-experts", "4", "--moe-ffn-hidden-size", str(I_MOE), "--moe-router-topk", "2",
            "--moe-layer-freq", "([1]*1+[0]*1)*2", "--moe-aux-loss-coeff", "1e-2",
        ],
        [
            "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
            "1", "--save-interval", "2",
        ],
    ),
}  # fmt: skip
TOKENS = torch.randint(0, 120, (2, 16), generator=torch.Generator().manual_seed(0))
PROMPT = torch.randint(0, 120, (1, 5), generator=torch.Generator().manual_seed(1))
_EVAL = re.compile(r"validation loss at iteration 0 on validation set \| lm loss value: (\S+) \|")

#: Hugging Face models made here: (config kwargs, dtype, the 2-process layouts their imported
#: release is resharded through).
HF_MODELS = {
    "qwen3_moe": (
        dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
            intermediate_size=40, mlp_only_layers=[1], norm_topk_prob=True, num_hidden_layers=2,
        ),
        torch.bfloat16,
        ("ep2", "etp2"),
    ),
    "mixtral": (
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24, num_hidden_layers=2),
        torch.float32,
        ("tp2",),
    ),
    "qwen3": (
        dict(intermediate_size=40, num_hidden_layers=2, tie_word_embeddings=True),
        torch.float32,
        ("tp2",),
    ),
    "llama": (dict(intermediate_size=40, num_hidden_layers=2), torch.float32, ("pp2",)),
}  # fmt: skip
LAYOUTS = {
    "tp2": dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=2),
    "pp2": dict(pipeline_model_parallel_size=2),
    "ep2": dict(expert_model_parallel_size=2),
    "etp2": dict(expert_tensor_parallel_size=2),
}


# --- references ------------------------------------------------------------------------------


def _reference(path, vocab):
    """``(logits [2, 16, vocab] float64 on TOKENS, 16 greedy tokens after PROMPT)`` of a
    1-process megatron-core ``GPTModel`` built from the checkpoint's Megatron-LM ``args`` with
    Megatron-LM's config builder and megatron-core's local block spec, its weights loaded by
    ``dist_checkpointing`` (which reshards); greedy decoding by a full forward per token."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.training.argument_utils import core_transformer_config_from_args

    saved = dist_checkpointing.load_common_state_dict(path)["args"]
    args = one_process_args(saved)
    args.virtual_pipeline_model_parallel_size = None
    args.num_layers_per_virtual_pipeline_stage = None
    args.num_virtual_stages_per_pipeline_rank = None
    try:
        config = core_transformer_config_from_args(args)
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization=args.normalization
        )
        model = GPTModel(
            config,
            spec,
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_base=args.rotary_base,
            rotary_percent=args.rotary_percent,
        ).eval()
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
        model.load_state_dict(state["model"])

        def logits_of(ids):
            positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
            with torch.no_grad():
                return model(ids, positions, None)[..., :vocab].double()

        ids = PROMPT
        for _ in range(16):
            ids = torch.cat([ids, logits_of(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return logits_of(TOKENS), ids
    finally:
        parallel_state.destroy_model_parallel()


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


def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _hf_logits(path):
    with torch.no_grad():
        return _hf_model(path)(TOKENS).logits.double()


from tests.unit.test_conversion_output import _cli, snapshot  # noqa: E402  (the CLI, in process)

# --- children --------------------------------------------------------------------------------


def _make_hf(path, model_type, kwargs, dtype):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        model_type,
        vocab_size=120,
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


def _convert_child(rank, world, *, roots, hf_root):
    """1 process: for each trained case export ``ckpt`` -> ``hf``, the reference of ``ckpt``,
    import ``hf`` -> ``imported``, export ``imported`` -> ``hf2``; the switch checkpoint
    through the CLI and the baseline one; an old-format checkpoint through the CLI; each
    Hugging Face model of :data:`HF_MODELS` made and imported (``m1``) and exported back
    (``hf2``); the Mixtral imported again through the CLI (``train``) for a run."""
    from megatron.core import dist_checkpointing

    from tst_megatron.conversion import export_checkpoint, import_checkpoint

    out = {}
    for name, root in roots.items():
        ckpt = os.path.join(root, "ckpt")
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
            latest = os.path.join(ckpt, f"iter_{int(f.read()):07d}")
        exported = export_checkpoint(ckpt, os.path.join(root, "hf"))
        logits, greedy = _reference(latest, VOCAB[name])
        imported = import_checkpoint(
            os.path.join(root, "hf"),
            os.path.join(root, "imported"),
            make_vocab_size_divisible_by=64,
        )
        export_checkpoint(os.path.join(root, "imported"), os.path.join(root, "hf2"))
        out[name] = dict(
            latest=latest,
            logits=logits,
            greedy=greedy,
            architecture=exported["architecture"],
            flags=imported["flags"],
        )
    q = roots[QWEN]
    switch = os.path.join(q, "switch")
    out["switch_cli"] = _cli("export", "--load", os.path.join(q, "ckpt"), "--ckpt-step", 2,
                             "--save", switch)  # fmt: skip
    mtimes = {p: os.path.getmtime(os.path.join(switch, p)) for p in os.listdir(switch)}
    out["switch_refused"] = _cli("export", "--load", os.path.join(q, "ckpt"), "--save", switch)
    out["switch_untouched"] = mtimes == {
        p: os.path.getmtime(os.path.join(switch, p)) for p in os.listdir(switch)
    }
    # the cases that once deleted a run (issue 56): with --force, each is one line, exit 2
    ck = os.path.join(q, "ckpt")
    before = snapshot(q)
    out["own_checkpoint"] = [
        _cli("export", "--load", ck, "--save", ck, "--force"),
        _cli("export", "--load", os.path.join(ck, "iter_0000002"), "--save", ck, "--force"),
        _cli("export", "--load", ck, "--save", os.path.join(ck, "hf"), "--force"),
        _cli("export", "--load", ck, "--save", q, "--force"),  # holds --load and other exports
        _cli("import", "--load", switch, "--save", switch, "--force"),
        _cli("import", "--load", switch, "--save", ck, "--force"),
    ]
    out["own_checkpoint_intact"] = snapshot(q) == before
    out["switch_logits"] = _reference(os.path.join(q, "ckpt", "iter_0000002"), VOCAB[QWEN])[0]
    export_checkpoint(os.path.join(q, "base"), os.path.join(q, "basehf"), ckpt_step=2)

    old = os.path.join(hf_root, "old", "iter_0000003")  # the hand-written trainer's layout
    os.makedirs(old)
    dist_checkpointing.save({"args": {"model": {"num_layers": 2}}, "loop": {"iteration": 3}}, old)
    out["old_refused"] = _cli("export", "--load", old, "--save", os.path.join(hf_root, "oldhf"))

    for model_type, (kwargs, dtype, _) in HF_MODELS.items():
        base = os.path.join(hf_root, model_type)
        _make_hf(os.path.join(base, "hf"), model_type, kwargs, dtype)
        import_checkpoint(
            os.path.join(base, "hf"),
            os.path.join(base, "m1"),
            make_vocab_size_divisible_by=64,
            tensor_model_parallel_size=2,
        )
        export_checkpoint(os.path.join(base, "m1"), os.path.join(base, "hf2"))
    mixtral = os.path.join(hf_root, "mixtral")
    out["train_import"] = _cli("import", "--load", os.path.join(mixtral, "hf"), "--save",
                               os.path.join(mixtral, "train"), "--make-vocab-size-divisible-by",
                               64)  # fmt: skip
    return out


def _reshard(rank, *, src, dst, layout):
    """Load the release ``src`` into the 2-process ``layout`` with the launcher's model builder
    and save it as the release ``dst`` from there; return this rank's parameter count."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core import parallel_state as ps

    from tst_megatron.conversion.megatron import load_weights
    from tst_megatron.conversion.mlm import one_process_args
    from tst_megatron.models.gpt import build_gpt_model_from_args
    from tst_megatron.runtime import initialize_model_parallel
    from tst_megatron.runtime.distributed import ParallelConfig

    saved = dist_checkpointing.load_common_state_dict(os.path.join(src, "release"))["args"]
    args = one_process_args(saved)
    for name, value in LAYOUTS[layout].items():
        setattr(args, name, value)
    args.sequence_parallel = layout == "tp2"
    initialize_model_parallel(ParallelConfig(**LAYOUTS[layout]))
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    try:
        model = build_gpt_model_from_args(
            args,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
        )
        load_weights(os.path.join(src, "release"), model)
        final = os.path.join(dst, "release")
        if rank == 0:
            os.makedirs(final)
        dist.barrier()
        state = {"model": model.sharded_state_dict(), "args": saved, "iteration": 0}
        dist_checkpointing.save(dict(state, checkpoint_version=3.0), final)
        dist.barrier()
        if rank == 0:
            with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("release")
        return sum(p.numel() for p in model.parameters())
    finally:
        ps.destroy_model_parallel()


def _runs_child(rank, world, *, runs):
    """The launcher's runs one after another in this process (what each printed), each with a
    fresh megatron-core MoE metrics tracker: the tracker is a module global that
    ``destroy_global_state`` keeps, sized by the first MoE run's layer count."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    printed = []
    for run in runs:
        destroy_moe_metrics_tracker()
        printed += _launcher_child(rank, world, runs=[run])
    return printed


def _load_child(rank, world, *, reshard, runs):
    """2 processes: the reshard jobs, then the launcher runs."""
    held = [_reshard(rank, **job) for job in reshard]
    return held, _runs_child(rank, world, runs=runs)


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each case trained 3 steps (switch at 2) by the launcher on 2 processes, saved at 3 (and
    the Qwen3-MoE at 2), with a baseline (bag size 1) Qwen3-MoE run saved at 2; then, in one
    process, :func:`_convert_child`."""
    roots = {name: str(tmp_path_factory.mktemp(name)) for name in CASES}
    runs = [
        MODEL + arch + RUN + SAVE + layout + ["--vocab-size", str(VOCAB[name])]
        + ["--save", os.path.join(roots[name], "ckpt")]
        for name, (arch, layout) in CASES.items()
    ]  # fmt: skip
    arch, layout = CASES[QWEN]
    runs.append(
        MODEL + arch + RUN + SAVE + layout + ["--vocab-size", str(VOCAB[QWEN])]
        + ["--tst-bag-size", "1", "--train-iters", "2", "--save", os.path.join(roots[QWEN], "base")]
    )  # fmt: skip
    printed = run_distributed(_runs_child, 2, runs=runs)[0]
    for text in printed[:-1]:
        assert "TST: phase 2 (next-token) from iteration 2 (switch at 2)" in text, text[-2000:]
    hf_root = str(tmp_path_factory.mktemp("hf_models"))
    (out,) = run_distributed(_convert_child, 1, roots=roots, hf_root=hf_root)
    return roots, hf_root, out


@pytest.fixture(scope="module")
def loaded(converted):
    """2 processes: each Hugging Face model's release resharded through its layouts; then the
    launcher loads each case's own checkpoint (--finetune) and its imported release into
    another layout (--skip-train), and trains the CLI-imported Mixtral with the printed
    flags (EP=2, --save into the --load directory). Returns ``(rank-0 parameter counts per
    reshard job, last layout per model, rank-0 printed, rank-1 printed)``."""
    roots, hf_root, out = converted
    jobs, last = [], {}
    for model_type, (_, _, layouts) in HF_MODELS.items():
        base = os.path.join(hf_root, model_type)
        for i, layout in enumerate(layouts):
            src, dst = os.path.join(base, f"m{i + 1}"), os.path.join(base, f"m{i + 2}")
            jobs.append(dict(src=src, dst=dst, layout=layout))
        last[model_type] = os.path.join(base, f"m{len(layouts) + 1}")
    runs = []
    for name, (arch, _) in CASES.items():
        other = {  # saved with TP=2 / EP=2 / PP=2+VPP: loaded with PP=2 / TP=2 / EP=2
            "llama-untied-tp2": ["--pipeline-model-parallel-size", "2"],
            "mixtral-tied-ep2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
            QWEN: ["--expert-model-parallel-size", "2"],
        }[name]
        run = (
            RUN + other + ["--skip-train", "--seq-length", "16", "--max-position-embeddings", "16"]
        )
        own = os.path.join(roots[name], "ckpt")
        vocab = ["--vocab-size", str(VOCAB[name])]
        runs.append(MODEL + arch + vocab + run + ["--load", own, "--finetune"])
        runs.append(out[name]["flags"] + run + ["--load", os.path.join(roots[name], "imported")])
    status, stdout, stderr = out["train_import"]
    assert status == 0, stderr
    flags = stdout.split("train from it with: ")[1].splitlines()[0].split()
    runs.append(
        flags + RUN + SAVE + ["--lr", "1e-4", "--seq-length", "16"]
        + ["--expert-model-parallel-size", "2"]
        + ["--save", flags[flags.index("--load") + 1]]
    )  # fmt: skip
    first, second = run_distributed(_load_child, 2, reshard=jobs, runs=runs)
    return first[0], last, first[1], second[1]


# --- Megatron-LM checkpoint -> Hugging Face -------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_exported_logits_equal_megatron_cores(converted, name):
    roots, _, out = converted
    V = VOCAB[name]
    config = json.load(open(os.path.join(roots[name], "hf", "config.json")))
    expected = {"mixtral": "MixtralForCausalLM", "llama": "LlamaForCausalLM"}
    assert config["architectures"] == [expected.get(name.split("-")[0], "Qwen3MoeForCausalLM")]
    assert config["tie_word_embeddings"] == ("-tied" in name)
    assert (config["vocab_size"], config["rms_norm_eps"], config["num_key_value_heads"]) == (
        V,
        1e-6,
        2,
    )
    if name == QWEN:
        assert config["mlp_only_layers"] == [1, 3]
        assert (config["intermediate_size"], config["moe_intermediate_size"]) == (64, I_MOE)
    theirs = _hf_logits(os.path.join(roots[name], "hf"))
    ours = out[name]["logits"]
    assert theirs.shape == ours.shape == (2, 16, V)
    assert ours.abs().max().item() > 0.1  # not a degenerate model
    assert (theirs - ours).abs().max().item() <= 1e-5  # measured: 0 (dense), 1.2e-7 (MoE)


@pytest.mark.parametrize("name", [QWEN, "mixtral-tied-ep2"])
def test_greedy_generation_matches_megatron(converted, name):
    roots, _, out = converted
    model = _hf_model(os.path.join(roots[name], "hf"))
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = model.generate(PROMPT, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert theirs.shape == (1, 21)
    assert theirs.tolist() == out[name]["greedy"].tolist()


def test_exported_weights_are_the_checkpoint_tensors(converted):
    """Stock-PyTorch read of the launcher's torch_dist files vs the safetensors (MoE case)."""
    from safetensors.torch import load_file

    roots, _, out = converted
    name = "mixtral-tied-ep2"
    V = VOCAB[name]
    plain = _dcp_plain(out[name]["latest"])
    assert any(k.startswith("optimizer.") for k in plain)  # Megatron-LM's full checkpoint
    hf = load_file(os.path.join(roots[name], "hf", "model.safetensors"))
    assert torch.equal(
        hf["model.embed_tokens.weight"], plain["embedding.word_embeddings.weight"][:V]
    )
    assert "lm_head.weight" not in hf
    fc1 = plain["decoder.layers.mlp.experts.experts.linear_fc1.weight"]  # [L, E, 2I, h]
    fc2 = plain["decoder.layers.mlp.experts.experts.linear_fc2.weight"]  # [L, E, h, I]
    qkv = plain["decoder.layers.self_attention.linear_qkv.weight"]  # [L, G*(Q/G+2)*d, h]
    proj = plain["decoder.layers.self_attention.linear_proj.weight"]  # [L, h, Q*d]
    for layer in range(2):
        p = f"model.layers.{layer}."
        assert torch.equal(
            hf[p + "block_sparse_moe.gate.weight"], plain["decoder.layers.mlp.router.weight"][layer]
        )
        for e in range(4):
            x = p + f"block_sparse_moe.experts.{e}."
            assert torch.equal(hf[x + "w1.weight"], fc1[layer, e, :I_MOE])
            assert torch.equal(hf[x + "w3.weight"], fc1[layer, e, I_MOE:])
            assert torch.equal(hf[x + "w2.weight"], fc2[layer, e])
        # group 0 of 2 holds query heads 0, 1 then k_0, v_0 (16 rows each)
        rows = qkv[layer, : 4 * 16]
        assert torch.equal(hf[p + "self_attn.q_proj.weight"][: 2 * 16], rows[:32])
        assert torch.equal(hf[p + "self_attn.k_proj.weight"][:16], rows[32:48])
        assert torch.equal(hf[p + "self_attn.v_proj.weight"][:16], rows[48:])
        assert torch.equal(hf[p + "self_attn.o_proj.weight"], proj[layer])


def test_switch_checkpoint_exports_like_a_baseline_one(converted):
    """The TST checkpoint at the switch (exported by the CLI with --ckpt-step) has the names,
    shapes and config of a baseline (bag size 1) run's at the same step, and its logits are
    megatron-core's; the CLI refuses to overwrite without --force and leaves the files."""
    from safetensors.torch import load_file

    roots, _, out = converted
    q = roots[QWEN]
    status, stdout, stderr = out["switch_cli"]
    assert status == 0 and "as Qwen3-MoE" in stdout, stdout + stderr
    status, _, stderr = out["switch_refused"]
    assert status == 2
    assert stderr.strip().splitlines() == [
        f"error: {os.path.join(q, 'switch')} exists (a previous export); pass --force to replace it"
    ]
    assert out["switch_untouched"]
    for status, _, stderr in out["own_checkpoint"]:  # every file of the run byte for byte
        assert status == 2 and stderr.startswith("error: --save ") and stderr.count("\n") == 1
    assert out["own_checkpoint_intact"]
    switch = load_file(os.path.join(q, "switch", "model.safetensors"))
    base = load_file(os.path.join(q, "basehf", "model.safetensors"))
    assert {k: v.shape for k, v in switch.items()} == {k: v.shape for k, v in base.items()}
    assert json.load(open(os.path.join(q, "switch", "config.json"))) == json.load(
        open(os.path.join(q, "basehf", "config.json"))
    )
    theirs = _hf_logits(os.path.join(q, "switch"))
    assert (theirs - out["switch_logits"]).abs().max().item() <= 1e-5
    assert not torch.equal(switch["lm_head.weight"], base["lm_head.weight"])  # other runs


def test_old_trainer_checkpoint_is_refused_in_one_line(converted):
    _, hf_root, out = converted
    status, stdout, stderr = out["old_refused"]
    assert status == 2 and not os.path.exists(os.path.join(hf_root, "oldhf"))
    (line,) = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert stderr.strip().splitlines()[-1] == line  # warnings of the loading may come first
    assert line.startswith("error: ") and "no longer read" in line and "0dc9f79" in line, line


# --- Hugging Face -> Megatron-LM checkpoint -------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_import_round_trip_is_bitwise(converted, name):
    """HF -> Megatron -> HF gives the same safetensors; the imported release holds the
    launcher checkpoint's weights bit for bit (padding rows zero) and Megatron-LM's common
    entries (``args`` namespace, iteration 0, ``release`` tracker)."""
    from argparse import Namespace

    from megatron.core import dist_checkpointing
    from safetensors.torch import load_file

    roots, _, out = converted
    root, V = roots[name], VOCAB[name]
    before = load_file(os.path.join(root, "hf", "model.safetensors"))
    after = load_file(os.path.join(root, "hf2", "model.safetensors"))
    assert sorted(before) == sorted(after)
    for key in before:
        assert before[key].dtype == after[key].dtype == torch.float32, key
        assert torch.equal(before[key], after[key]), key
    assert open(os.path.join(root, "imported", "latest_checkpointed_iteration.txt")).read() == (
        "release"
    )
    release = os.path.join(root, "imported", "release")
    common = dist_checkpointing.load_common_state_dict(release)
    assert isinstance(common["args"], Namespace)
    assert (common["iteration"], common["checkpoint_version"]) == (0, 3.0)
    layers = 4 if name == QWEN else 2
    assert (common["args"].padded_vocab_size, common["args"].num_layers) == (128, layers)
    original, imported = _dcp_plain(out[name]["latest"]), _dcp_plain(release)
    assert not any(k.startswith("optimizer.") for k in imported)
    for key, value in imported.items():
        if key.endswith(("embedding.word_embeddings.weight", "output_layer.weight")):
            assert torch.equal(value[:V], original[key][:V]), key
            assert not value[V:].any(), key
        else:
            assert torch.equal(value, original[key]), key


def test_round_trip_hf_megatron_hf_is_bit_identical(converted, loaded):
    """Each architecture (Qwen3-MoE in bf16 with a dense layer, the rest fp32): HF -> release
    -> HF bit for bit, with the config; the release, loaded by 2 processes in other layouts
    with the launcher's model builder and saved from there, holds the same tensors."""
    from safetensors.torch import load_file

    _, hf_root, _ = converted
    held, last, _, _ = loaded
    held = iter(held)
    for model_type, (kwargs, dtype, layouts) in HF_MODELS.items():
        base = os.path.join(hf_root, model_type)
        before = load_file(os.path.join(base, "hf", "model.safetensors"))
        after = load_file(os.path.join(base, "hf2", "model.safetensors"))
        assert min(next(held) for _ in layouts) < sum(t.numel() for t in before.values())
        if kwargs.get("tie_word_embeddings") and "lm_head.weight" in before:
            del before["lm_head.weight"]  # a tied model's output weight is stored once
        assert sorted(before) == sorted(after), model_type
        for name in before:
            assert before[name].dtype == after[name].dtype == dtype, name
            assert torch.equal(before[name], after[name]), name
        c1 = json.load(open(os.path.join(base, "hf", "config.json")))
        c2 = json.load(open(os.path.join(base, "hf2", "config.json")))
        for key in (
            "architectures", "num_hidden_layers", "hidden_size", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "tie_word_embeddings", "vocab_size", "dtype",
            "mlp_only_layers", "norm_topk_prob", "intermediate_size", "moe_intermediate_size",
            "rope_parameters", "router_aux_loss_coef", "num_experts_per_tok",
        ):  # fmt: skip
            assert c1.get(key) == c2.get(key), (model_type, key)
        m1, resharded = (
            _dcp_plain(os.path.join(base, "m1", "release")),
            _dcp_plain(os.path.join(last[model_type], "release")),
        )
        assert sorted(m1) == sorted(resharded), model_type
        for key in m1:
            assert torch.equal(m1[key], resharded[key]), (model_type, key)


def test_imported_release_loads_in_the_launcher(loaded):
    """The launcher's --load (Megatron-LM's load_checkpoint) reads each imported release with
    the flags the import prints into another 2-process layout: its validation loss (first
    batch, no training: --skip-train) equals that of the launcher's own checkpoint loaded as
    weights only (--finetune). Exactly without vocabulary padding; with it, the padded rows
    (trained in the checkpoint, zero in the import, absent from Hugging Face) enter
    Megatron-LM's softmax, so the losses differ slightly."""
    _, _, first, last = loaded
    for i, name in enumerate(CASES):
        assert "loading release distributed checkpoint" in first[2 * i + 1], first[2 * i + 1]
        own, imported = last[2 * i], last[2 * i + 1]
        a, b = _EVAL.findall(own), _EVAL.findall(imported)
        assert len(a) == len(b) == 1, (own[-2000:], imported[-2000:])
        padded = VOCAB[name] % 128 != 0
        # measured with padding: rel 1.5e-3 (Qwen3-MoE, untied: its trained padded output rows)
        assert float(b[0]) == pytest.approx(float(a[0]), rel=1e-2 if padded else 1e-6), name
        if padded:
            assert float(b[0]) != float(a[0])


def test_imported_checkpoint_trains_with_the_printed_flags(converted, loaded):
    """A Mixtral imported by the CLI continues pretraining on 2 processes (EP=2) from --load
    (into the same directory, as Megatron users do) with the flags the import prints."""
    _, hf_root, _ = converted
    _, _, first, last = loaded
    assert "loading release distributed checkpoint" in first[-1], first[-1][-2000:]
    train, _ = _losses(last[-1])  # Megatron-LM logs the losses on the last rank
    assert sorted(train) == [1, 2, 3] and all(math.isfinite(float(v)) for v in train.values())
    root = os.path.join(hf_root, "mixtral", "train")
    assert open(os.path.join(root, "latest_checkpointed_iteration.txt")).read().strip() == "3"
    # the run started from the imported weights: 3 small steps later they are close to them
    # (a fresh initialisation would be ~0.5 away: the HF weights are drawn with std 0.5)
    start = _dcp_plain(os.path.join(root, "release"))
    end = _dcp_plain(os.path.join(root, "iter_0000003"))
    for key in ("embedding.word_embeddings.weight", "decoder.layers.mlp.router.weight"):
        change = (end[key] - start[key]).abs().max().item()
        assert 0 < change < 1e-2, key
