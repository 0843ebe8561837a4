"""Run a function on N gloo processes spawned from plain pytest; collect what each returns.

The port is chosen once per call by binding to port 0. Each child initialises
``torch.distributed`` through ``tst_megatron.runtime.init_distributed(device="cpu")``
(which enables the CPU runtime), runs ``fn(rank, world_size, **kwargs)`` and saves the
return value with ``torch.save``; the parent loads them and returns ``[result_rank0, ...]``.
"""

from __future__ import annotations

import os
import tempfile
import traceback

import torch
import torch.multiprocessing as mp

from tst_megatron.runtime.distributed import free_port


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

    from tst_megatron.training.gpt import TSTGPTModel
    from tst_megatron.training.model import gpt_block_spec, tag_expert_grad_reduction

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
