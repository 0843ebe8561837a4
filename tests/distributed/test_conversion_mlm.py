"""Hugging Face conversion of checkpoints written by Megatron-LM's own loop.

Tiny models are trained through the TST switch by the launcher on
``megatron.training.pretrain()`` (:func:`tst_megatron.training.megatron_lm.main`) on 2 gloo
processes (a Llama-style dense model with TP=2 + SP, a Mixtral-style MoE with EP=2), so the
checkpoints are Megatron-LM's own (its ``args`` namespace, tracker file, optimizer state).
They are exported to Hugging Face and imported back, and the imported ``release`` is loaded
by the launcher's ``--load`` (Megatron-LM's ``load_checkpoint``) into a 2-process layout.

References, written here: megatron-core's ``GPTModel`` built from the checkpoint's saved
``args`` with Megatron-LM's ``core_transformer_config_from_args`` and megatron-core's local
layer spec (not the converter's model builder); the checkpoint's tensors read with stock
``torch.distributed.checkpoint``, mapped by hand.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

pytest.importorskip("megatron.training")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.distributed.harness import run_distributed  # noqa: E402
from tests.distributed.test_megatron_lm import _pretrain_child as _launcher_child  # noqa: E402

pytestmark = pytest.mark.slow
H, I_MOE = 32, 24  # hidden size, expert FFN width
#: Vocabulary per case: 120 rows padded to 128 (the export drops the padding, the import
#: zero-fills it), and 128 with no padding (the launcher's loss covers the padded rows too).
VOCAB = {"llama-untied-tp2": 120, "mixtral-tied-ep2": 128}

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
}  # fmt: skip
TOKENS = torch.randint(0, 120, (2, 16), generator=torch.Generator().manual_seed(0))
_EVAL = re.compile(r"validation loss at iteration 0 on validation set \| lm loss value: (\S+) \|")


def _reference_logits(path, tokens, vocab):
    """Logits ``[b, s, vocab]`` (float64) of a 1-process megatron-core ``GPTModel`` built from
    the checkpoint's Megatron-LM ``args`` with Megatron-LM's config builder and megatron-core's
    local layer spec, its weights loaded by ``dist_checkpointing`` (which reshards)."""
    import copy

    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training.argument_utils import core_transformer_config_from_args

    saved = dist_checkpointing.load_common_state_dict(path)["args"]
    args = copy.copy(saved)
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
    ):
        setattr(args, name, 1)
    args.sequence_parallel = False
    if parallel_state.model_parallel_is_initialized():  # left by the converter's world
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    try:
        config = core_transformer_config_from_args(args)
        spec = get_gpt_layer_local_spec(
            num_experts=args.num_experts,
            moe_grouped_gemm=False,
            qk_layernorm=args.qk_layernorm,
            normalization=args.normalization,
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
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        with torch.no_grad():
            return model(tokens, positions, None)[..., :vocab].double()
    finally:
        parallel_state.destroy_model_parallel()


def _convert_child(rank, world, *, roots):
    """For each case root: export ``ckpt`` -> ``hf``, the reference logits of ``ckpt``,
    import ``hf`` -> ``imported``, export ``imported`` -> ``hf2``."""
    from tst_megatron.conversion import export_checkpoint, import_checkpoint

    out = {}
    for name, root in roots.items():
        ckpt = os.path.join(root, "ckpt")
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
            latest = os.path.join(ckpt, f"iter_{int(f.read()):07d}")
        exported = export_checkpoint(ckpt, os.path.join(root, "hf"))
        logits = _reference_logits(latest, TOKENS, VOCAB[name])
        imported = import_checkpoint(
            os.path.join(root, "hf"),
            os.path.join(root, "imported"),
            make_vocab_size_divisible_by=64,
        )
        export_checkpoint(os.path.join(root, "imported"), os.path.join(root, "hf2"))
        out[name] = dict(
            latest=latest,
            logits=logits,
            architecture=exported["architecture"],
            flags=imported["flags"],
        )
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each case trained 3 steps (switch at 2) by the launcher on 2 processes, saved at 3,
    then exported, imported back and exported again (1 process)."""
    roots = {name: str(tmp_path_factory.mktemp(name)) for name in CASES}
    runs = [
        MODEL + arch + RUN + layout + ["--vocab-size", str(VOCAB[name])]
        + ["--save", os.path.join(roots[name], "ckpt")]
        + ["--save-interval", "3", "--ckpt-format", "torch_dist"]
        for name, (arch, layout) in CASES.items()
    ]  # fmt: skip
    printed = run_distributed(_launcher_child, 2, runs=runs)[0]
    for text in printed:
        assert "TST: phase 2 (next-token) from iteration 2 (switch at 2)" in text, text[-2000:]
    (out,) = run_distributed(_convert_child, 1, roots=roots)
    return roots, out


def _hf_logits(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(TOKENS).logits.double()


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


@pytest.mark.parametrize("name", list(CASES))
def test_exported_logits_equal_megatron_cores(converted, name):
    roots, out = converted
    V = VOCAB[name]
    config = json.load(open(os.path.join(roots[name], "hf", "config.json")))
    expected = "MixtralForCausalLM" if name.startswith("mixtral") else "LlamaForCausalLM"
    assert config["architectures"] == [expected]
    assert config["tie_word_embeddings"] == ("-tied" in name)
    assert (config["vocab_size"], config["rms_norm_eps"], config["num_key_value_heads"]) == (
        V,
        1e-6,
        2,
    )
    theirs = _hf_logits(os.path.join(roots[name], "hf"))
    ours = out[name]["logits"]
    assert theirs.shape == ours.shape == (2, 16, V)
    assert ours.abs().max().item() > 0.1  # not a degenerate model
    assert (theirs - ours).abs().max().item() <= 1e-5  # measured: 0 (dense), 1.2e-7 (MoE)


def test_exported_weights_are_the_checkpoint_tensors(converted):
    """Stock-PyTorch read of the launcher's torch_dist files vs the safetensors (MoE case)."""
    from safetensors.torch import load_file

    roots, out = converted
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


@pytest.mark.parametrize("name", list(CASES))
def test_import_round_trip_is_bitwise(converted, name):
    """HF -> Megatron -> HF gives the same safetensors; the imported release holds the
    launcher checkpoint's weights bit for bit (padding rows zero) and Megatron-LM's common
    entries (``args`` namespace, iteration 0, ``release`` tracker)."""
    from argparse import Namespace

    from megatron.core import dist_checkpointing
    from safetensors.torch import load_file

    roots, out = converted
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
    assert (common["args"].padded_vocab_size, common["args"].num_layers) == (128, 2)
    original, imported = _dcp_plain(out[name]["latest"]), _dcp_plain(release)
    assert not any(k.startswith("optimizer.") for k in imported)
    for key, value in imported.items():
        if key.endswith(("embedding.word_embeddings.weight", "output_layer.weight")):
            assert torch.equal(value[:V], original[key][:V]), key
            assert not value[V:].any(), key
        else:
            assert torch.equal(value, original[key]), key


def test_imported_release_loads_in_the_launcher(converted):
    """The launcher's --load (Megatron-LM's load_checkpoint) reads each imported release with
    the flags the import prints into another 2-process layout: its validation loss (first
    batch, no training: --skip-train) equals that of the launcher's own checkpoint loaded as
    weights only (--finetune). Exactly without vocabulary padding; with it, the padded rows
    (trained in the checkpoint, zero in the import, absent from Hugging Face) enter
    Megatron-LM's softmax, so the losses differ slightly."""
    roots, out = converted
    runs = []
    for name, (arch, _) in CASES.items():
        other = (  # saved with EP=2 / TP=2: loaded with TP=2 (experts too) / PP=2
            ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
            if name.startswith("mixtral")
            else ["--pipeline-model-parallel-size", "2"]
        )
        run = (
            RUN + other + ["--skip-train", "--seq-length", "16", "--max-position-embeddings", "16"]
        )
        own = os.path.join(roots[name], "ckpt")
        vocab = ["--vocab-size", str(VOCAB[name])]
        runs.append(MODEL + arch + vocab + run + ["--load", own, "--finetune"])
        runs.append(out[name]["flags"] + run + ["--load", os.path.join(roots[name], "imported")])
    first, last = run_distributed(_launcher_child, 2, runs=runs)
    for i, name in enumerate(CASES):
        assert "loading release distributed checkpoint" in first[2 * i + 1], first[2 * i + 1]
        own, imported = last[2 * i], last[2 * i + 1]
        a, b = _EVAL.findall(own), _EVAL.findall(imported)
        assert len(a) == len(b) == 1, (own[-2000:], imported[-2000:])
        padded = VOCAB[name] % 128 != 0
        assert float(b[0]) == pytest.approx(float(a[0]), rel=1e-3 if padded else 1e-6), name
        if padded:
            assert float(b[0]) != float(a[0])
