"""Checkpoint names across implementations: a checkpoint saved with megatron-core's
Transformer Engine spec and ``--moe-grouped-gemm`` (a GPU run of the launcher) loads into the
local spec (the checkpoint converter, which builds its 1-process model with the local spec on
the CPU and reads through ``tst_megatron.conversion.megatron.load_weights``), and the reverse
(``load_sharded`` with a request under the TE spec's names).

The TE spec's names are written out below from megatron-core's sources (it cannot be built
without Transformer Engine; where TE imports, the last test builds it and checks the table):
- ``get_gpt_layer_with_transformer_engine_spec``: the input norm is fused into
  ``self_attention.linear_qkv`` (``TELayerNormColumnParallelLinear``: ``layer_norm_weight``);
  a dense layer's pre-MLP norm is fused into ``mlp.linear_fc1``; an MoE layer keeps a separate
  ``pre_mlp_layernorm`` (``TENorm``);
- ``TEGroupedMLP.sharded_state_dict`` / ``TEGroupedLinear._sharded_state_dict_grouped``: one
  ``mlp.experts.experts.linear_fc{1,2}.weight`` (and ``._extra_state``) per expert along an
  expert axis, "interchangeable with SequentialMLP's";
- every TE module (linears and, from TE 2, norms) has an ``_extra_state`` (FP8 metadata).
The local spec differs in one name: its ``sharded_state_dict_keys_map`` renames *every*
``pre_mlp_layernorm.`` to ``mlp.linear_fc1.layer_norm_``, MoE layers included; and TE norms'
``_extra_state`` has no local counterpart. ``conversion.megatron.load_sharded`` reads across
both.
"""

import pytest
import torch

from tests.distributed.harness import run_distributed

H, FFN, MOE_FFN, E, V = 16, 32, 8, 2, 64


def te_names(kinds):
    """Sharded tensor keys and TE-only object keys of megatron-core's TE-spec GPT with the
    layers ``kinds`` (``"moe"`` / ``"dense"``), grouped GEMM experts, untied output layer."""
    # a moe_layer_freq pattern gives per-layer keys (TransformerBlock's non_homogeneous_layers),
    # MoE in every layer (moe_layer_freq=1) one key with a layer axis
    mixed = set(kinds) != {"moe"}
    tensors = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    tensors.add("output_layer.weight")
    te_only_objects = {"decoder.final_layernorm._extra_state"}
    for i, kind in enumerate(kinds):
        p = f"decoder.layers.{i}." if mixed else "decoder.layers."
        tensors |= {
            p + "self_attention.linear_qkv.layer_norm_weight",
            p + "self_attention.linear_qkv.weight",
            p + "self_attention.linear_proj.weight",
        }
        if kind == "moe":
            tensors |= {
                p + "pre_mlp_layernorm.weight",
                p + "mlp.router.weight",
                p + "mlp.experts.experts.linear_fc1.weight",
                p + "mlp.experts.experts.linear_fc2.weight",
            }
            te_only_objects.add(p + "pre_mlp_layernorm._extra_state")
        else:
            tensors |= {
                p + "mlp.linear_fc1.layer_norm_weight",
                p + "mlp.linear_fc1.weight",
                p + "mlp.linear_fc2.weight",
            }
    return tensors, te_only_objects


def to_local(name):
    """The one renaming of megatron-core's local spec (its sharded_state_dict_keys_map)."""
    return name.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")


CASES = {"all MoE": ["moe", "moe"], "MoE + dense": ["moe", "dense"]}


def _model(kinds, seed, transformer_impl="local"):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.distributed.harness import build_gpt_model
    from tst_megatron.runtime import set_seed

    set_seed(seed)
    config = TransformerConfig(
        num_layers=len(kinds),
        hidden_size=H,
        num_attention_heads=2,
        ffn_hidden_size=FFN,
        num_moe_experts=E,
        moe_ffn_hidden_size=MOE_FFN,
        moe_layer_freq=1 if set(kinds) == {"moe"} else [int(k == "moe") for k in kinds],
        moe_grouped_gemm=transformer_impl == "transformer_engine",
        normalization="RMSNorm",
        gated_linear_unit=True,
        add_bias_linear=False,
        use_cpu_initialization=True,
    )
    return build_gpt_model(
        config,
        vocab_size=V,
        max_sequence_length=8,
        transformer_impl=transformer_impl,
        share_embeddings_and_output_weights=False,
    )


def _tensor_keys(sharded):
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return {v.key for v in nested_values(sharded) if not isinstance(v, ShardedObject)}


def _te_named(sharded, kinds):
    """A local model's sharded state dict under the TE spec's names: MoE layers' pre-MLP norm
    renamed, plus the TE-only ``_extra_state`` objects of the TE norms (a byte tensor each,
    sharded along the layer axis like megatron-core's layer objects)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    mixed = set(kinds) != {"moe"}
    for value in sharded.values():
        for i, kind in enumerate(kinds):
            prefix = f"decoder.layers.{i}." if mixed else "decoder.layers."
            if kind == "moe" and value.key.startswith(prefix + "mlp.linear_fc1.layer_norm_"):
                value.key = value.key.replace("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm.")
    data = torch.arange(4, dtype=torch.uint8)
    sharded["decoder.final_layernorm._extra_state"] = ShardedObject(
        "decoder.final_layernorm._extra_state", data, (1,), (0,), replica_id=0
    )
    for i, kind in enumerate(kinds):
        if kind != "moe":
            continue
        if mixed:
            key, shape, offset = f"decoder.layers.{i}.pre_mlp_layernorm._extra_state", (1,), (0,)
        else:
            key, shape, offset = (
                "decoder.layers.pre_mlp_layernorm._extra_state",
                (len(kinds),),
                (i,),
            )
        sharded[f"{key}#{i}"] = ShardedObject(key, data, shape, offset, replica_id=0)
    return sharded


def _round_trip_child(rank, world, *, kinds, root):
    import os

    from megatron.core import dist_checkpointing

    from tst_megatron.conversion.megatron import load_sharded, load_weights
    from tst_megatron.runtime import ParallelConfig, initialize_model_parallel

    initialize_model_parallel(ParallelConfig())
    source = _model(kinds, 1)
    names = sorted(_tensor_keys(source.sharded_state_dict()))
    expected = {k: v.clone() for k, v in source.state_dict().items() if torch.is_tensor(v)}

    # TE-spec checkpoint -> local model (the converter's load)
    te_dir, local_dir = f"{root}/te", f"{root}/local"
    os.makedirs(te_dir), os.makedirs(local_dir)
    te_state = _te_named(source.sharded_state_dict(), kinds)
    dist_checkpointing.save({"model": te_state}, te_dir)
    target = _model(kinds, 2)
    load_weights(te_dir, target)
    te_to_local = sorted(
        k
        for k, v in target.state_dict().items()
        if torch.is_tensor(v) and not torch.equal(v, expected[k])
    )

    # local checkpoint -> a request under the TE spec's names (what a TE model asks for)
    dist_checkpointing.save({"model": source.sharded_state_dict()}, local_dir)
    request = _te_named(_model(kinds, 3).sharded_state_dict(), kinds)
    state = load_sharded({"model": request}, local_dir)["model"]
    local_to_te = sorted(
        k for k in expected if k in state and not torch.equal(state[k], expected[k])
    )
    extra = {k: state[k] for k in state if "#" in k or k == "decoder.final_layernorm._extra_state"}
    return {
        "names": names,
        "te_to_local_differs": te_to_local,
        "local_to_te_differs": local_to_te,
        "local_to_te_loaded": sorted(k for k in expected if k in state),
        "te_only_objects": extra,
        "expected": sorted(expected),
    }


@pytest.mark.parametrize("case", CASES)
def test_checkpoints_load_across_specs(case, tmp_path):
    kinds = CASES[case]
    (result,) = run_distributed(_round_trip_child, 1, kinds=kinds, root=str(tmp_path))
    # the local spec's names are the TE spec's but one (MoE layers' pre-MLP norm)
    te, _ = te_names(kinds)
    assert set(result["names"]) == {to_local(k) for k in te}
    renamed = {k for k in te if to_local(k) != k}
    assert renamed == {k for k in te if k.endswith("pre_mlp_layernorm.weight")}
    assert renamed or "moe" not in kinds
    # ... and checkpoints load across them, both ways
    assert result["te_to_local_differs"] == []
    assert result["local_to_te_differs"] == []
    assert result["local_to_te_loaded"] == result["expected"]
    # TE norms' FP8 metadata has no local counterpart: left as is (None) on load
    assert result["te_only_objects"] and all(v is None for v in result["te_only_objects"].values())


def _te_importable():
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def _te_names_child(rank, world, *, kinds):
    from tst_megatron.runtime import ParallelConfig, initialize_model_parallel

    initialize_model_parallel(ParallelConfig())
    return sorted(_tensor_keys(_model(kinds, 1, "transformer_engine").sharded_state_dict()))


@pytest.mark.skipif(not _te_importable(), reason="needs Transformer Engine and a GPU")
@pytest.mark.parametrize("case", CASES)
def test_te_spec_names_match_the_table(case):
    (keys,) = run_distributed(_te_names_child, 1, kinds=CASES[case])
    assert set(keys) == te_names(CASES[case])[0]
