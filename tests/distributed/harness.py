"""Run a function on N gloo processes spawned from plain pytest; collect what each returns.

The port is chosen once per call (:func:`tests.ports.free_port`). Each child initialises
``torch.distributed`` through ``tst_megatron.runtime.init_distributed(device="cpu")``
(which enables the CPU runtime), runs ``fn(rank, world_size, **kwargs)`` and saves the
return value with ``torch.save``; the parent loads them and returns ``[result_rank0, ...]``.
"""

from __future__ import annotations

import os
import tempfile
import traceback
import zlib

import torch
import torch.multiprocessing as mp

from tests.ports import free_port


def _child(rank, world_size, port, out_dir, fn, kwargs):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    from tst_megatron.runtime import destroy, init_distributed

    init_distributed(device="cpu", timeout_minutes=3)
    try:
        result = fn(rank, world_size, **kwargs)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        destroy()


def run_distributed(fn, world_size: int = 2, **kwargs):
    """Run ``fn(rank, world_size, **kwargs)`` on ``world_size`` spawned gloo processes."""
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(
                _child,
                args=(world_size, free_port(), out_dir, fn, kwargs),
                nprocs=world_size,
                start_method="spawn",
            )
        except Exception as exc:
            errors = [
                open(os.path.join(out_dir, name)).read()
                for name in sorted(os.listdir(out_dir))
                if name.endswith(".err")
            ]
            raise AssertionError("distributed run failed:\n" + "\n".join(errors)) from exc
        return [
            torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]


def build_gpt_model(
    config,
    *,
    vocab_size: int,
    max_sequence_length: int,
    transformer_impl: str = "local",
    pre_process: bool = True,
    post_process: bool = True,
    share_embeddings_and_output_weights: bool = False,
    vp_stage=None,
):
    """One stage of the launcher's model (``TSTGPTModel``, rope, vocab-parallel logits) from a
    ``TransformerConfig``, for tests that build a model without Megatron-LM's arguments: the
    launcher's local block spec, or megatron-core's Transformer Engine spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from tst_megatron.models.gpt import TSTGPTModel, gpt_block_spec
    from tst_megatron.models.layers import tag_expert_grad_reduction

    if transformer_impl == "local":
        spec = gpt_block_spec(config, vp_stage=vp_stage)
    else:
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, normalization=config.normalization
        )
    model = TSTGPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type="rope",
        vp_stage=vp_stage,
    )
    tag_expert_grad_reduction(model, config)
    return model


def small_config(
    *,
    num_layers: int = 2,
    hidden_size: int = 16,
    num_attention_heads: int = 2,
    ffn_hidden_size: int = 32,
    experts: int | None = None,
    moe_ffn_hidden_size: int = 16,
    tp: int = 1,
    **extra,
):
    """The tests' small ``TransformerConfig``: RMSNorm, no biases, CPU initialisation, no
    dropout, per-token loss; split over ``tp`` tensor-parallel ranks (sequence parallel when
    more than one); with ``experts``, an MoE of that many experts (top 2) of width
    ``moe_ffn_hidden_size``. ``extra`` adds or overrides fields."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=num_layers, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
    fields.update(num_attention_heads=num_attention_heads, normalization="RMSNorm")
    fields.update(add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)
    fields.update(use_cpu_initialization=True, calculate_per_token_loss=True)
    fields.update(tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
    if experts:
        fields.update(num_moe_experts=experts, moe_router_topk=2)
        fields.update(moe_ffn_hidden_size=moe_ffn_hidden_size)
    return TransformerConfig(**{**fields, **extra})


def set_weights(model):
    """Deterministic weights keyed by each parameter's name (norms around 1, the rest around
    0), so that models with the same parameter names hold the same weights."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            base = 1.0 if "norm" in name else 0.0
            param.copy_(base + 0.2 * torch.randn(param.shape, generator=g))


def tp_layer_config(world_size: int, *, hidden_size: int, sequence_parallel: bool):
    """A one-layer ``TransformerConfig`` (2 heads, no hidden dropout, CPU initialisation) split
    over ``world_size`` tensor-parallel ranks: what the embedding and output layers of the TP
    tests read."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    layer = dict(num_layers=1, hidden_size=hidden_size, num_attention_heads=2, hidden_dropout=0.0)
    split = dict(tensor_model_parallel_size=world_size, sequence_parallel=sequence_parallel)
    return TransformerConfig(**layer, **split, use_cpu_initialization=True)


def reference_bag_ce(logits, stream, mask, *, S: int, T: int):
    """Phase 1's per-slot cross-entropies in float64, from the definition: position ``j`` of
    sample ``b`` predicts tokens ``stream[b, (j+1)S + k]``, ``k < S``, each scored when it
    exists (the stream holds ``S*T + 1`` tokens) and its label's mask is 1. Returns ``(the CE
    terms, the number of positions with a scored slot)``."""
    import torch.nn.functional as F

    logits = logits.double()
    terms, positions = [], 0
    for b in range(stream.shape[0]):
        for j in range(T):
            scored = False
            for k in range(S):
                t = (j + 1) * S + k  # index in the stream of S*T + 1 tokens
                if t > S * T or mask[b, t - 1] == 0:
                    continue
                terms.append(F.cross_entropy(logits[b, j][None], stream[b, t][None]))
                scored = True
            positions += scored
    return terms, positions


def one_process_args(saved):
    """A copy of the Megatron-LM arguments ``saved`` in a checkpoint, set to one process (every
    parallel size 1, no sequence parallelism), with megatron-core's model-parallel state made
    afresh for one process (seed 0)."""
    import copy

    from megatron.core import parallel_state, tensor_parallel

    args = copy.copy(saved)
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    args.expert_model_parallel_size = args.expert_tensor_parallel_size = 1
    args.sequence_parallel = False
    if parallel_state.model_parallel_is_initialized():  # left by the converter's world
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    return args
