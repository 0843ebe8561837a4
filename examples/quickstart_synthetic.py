"""A tiny TST run on synthetic data: a small MoE GPT through phase 1 (bags), the switch,
and phase 2 (next-token), on CPU with 2 gloo processes (EP=2) or on GPUs.

Start with torchrun (scripts/quickstart.sh does):
    torchrun --nproc_per_node 2 examples/quickstart_synthetic.py --expert-model-parallel-size 2

Synthetic text: every sample is an arithmetic progression modulo the vocabulary with a
random start and stride, so both the bag targets and the next token are learnable.
This demo drives megatron-core's DDP, optimizer and pipeline schedule directly; the full
``pretrain_gpt``-style trainer (checkpoints, real data, evaluation) is a separate issue.
"""

from __future__ import annotations

import argparse
import time

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig

from tst_megatron.runtime import (
    ParallelConfig, destroy, init_distributed, initialize_model_parallel, set_seed,
)  # fmt: skip
from tst_megatron.superposition import (
    align_bag_targets, bag_embedding, bag_weights, fold_bags, multi_hot_cross_entropy,
    vocab_parallel_multi_target_cross_entropy,
)  # fmt: skip
from tst_megatron.training import build_gpt_model


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=32, help="T, latent positions")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--train-iters", type=int, default=200)
    p.add_argument("--tst-bag-size", type=int, default=4)
    p.add_argument("--tst-phase1-fraction", type=float, default=0.3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    return p.parse_args()


def synthetic_batch(step, dp_rank, batch, length, vocab, device):
    """``[b, length + 1]`` token ids: arithmetic progressions modulo ``vocab``."""
    g = torch.Generator().manual_seed(step * 1000 + dp_rank)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 5, (batch, 1), generator=g)
    return ((start + stride * torch.arange(length + 1)) % vocab).to(device)


def main():
    args = parse_args()
    info = init_distributed(device=args.device)
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    initialize_model_parallel(ParallelConfig(tensor_model_parallel_size=tp,
                                             expert_model_parallel_size=ep))  # fmt: skip
    set_seed(args.seed)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type="alltoall", normalization="RMSNorm", gated_linear_unit=True,
        add_bias_linear=False, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        sequence_parallel=tp > 1, use_cpu_initialization=info.device.type == "cpu",
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    model = build_gpt_model(config, vocab_size=args.vocab_size,
                            max_sequence_length=args.seq_length).to(info.device)  # fmt: skip
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, bf16=False, clip_grad=1.0), [model]
    )
    gpt = model.module
    tp_group = ps.get_tensor_model_parallel_group()
    bag, T, b = args.tst_bag_size, args.seq_length, args.micro_batch_size
    phase1_iters = round(args.tst_phase1_fraction * args.train_iters)
    weights = bag_weights(bag)

    def phase1_step(data_iterator, model):
        tokens = next(data_iterator)
        bags = fold_bags(tokens[:, :-1], bag)
        targets, mask = align_bag_targets(tokens[:, 1:], torch.ones_like(tokens[:, 1:]), bag)
        out = model(None, None, None, decoder_input=bag_embedding(gpt.embedding, bags))

        def loss_func(logits):
            ce = vocab_parallel_multi_target_cross_entropy(logits, targets, tp_group=tp_group)
            loss_sum, weight_sum = multi_hot_cross_entropy(ce, mask, weights.to(ce.device))
            return loss_sum / weight_sum, {"loss": (loss_sum / weight_sum).detach()}

        return out, loss_func

    def phase2_step(data_iterator, model):
        tokens = next(data_iterator)
        positions = torch.arange(T, device=tokens.device).expand(b, -1)
        per_token = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:])
        return per_token, lambda out: (out.mean(), {"loss": out.mean().detach()})

    dp_rank = ps.get_data_parallel_rank()
    for step in range(args.train_iters):
        phase = 1 if step < phase1_iters else 2
        length = bag * T if phase == 1 else T
        data = iter([synthetic_batch(step, dp_rank, b, length, args.vocab_size, info.device)])
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=phase1_step if phase == 1 else phase2_step, data_iterator=data,
            model=[model], num_microbatches=1, seq_length=T, micro_batch_size=b,
        )  # fmt: skip
        _, grad_norm, _ = optimizer.step()
        if info.rank == 0 and (step % 10 == 0 or step in (phase1_iters - 1, phase1_iters)):
            kind = "MCE" if phase == 1 else "CE"
            print(f"iteration {step:4d} | phase {phase} | {kind} loss {losses[0]['loss'].item():.4f} "
                  f"| grad norm {grad_norm:.3f} | tokens/step {b * length * ps.get_data_parallel_world_size()} "
                  f"| {1000 * (time.perf_counter() - start):.0f} ms", flush=True)  # fmt: skip
        if step == phase1_iters - 1 and info.rank == 0:
            print(f"--- switch to next-token training at iteration {phase1_iters} ---", flush=True)
    destroy()


if __name__ == "__main__":
    main()
