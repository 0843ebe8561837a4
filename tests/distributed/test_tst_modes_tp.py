"""The three phase-1 modes (``--tst-mode full|input|output``) through the launcher's phase-1
forward step under tensor parallelism (2 gloo processes, with and without sequence
parallelism), against a float64 reference written plainly here from the token sequence.

The model is the method's part of a GPT: megatron-core's vocab-parallel
``LanguageModelEmbedding`` (learned absolute positions) and a vocab-parallel output layer,
with no transformer layers between them (they see ``[T, b, h]`` in every mode and are tested
elsewhere). The reference embeds each input bag as the mean of its token embeddings plus
the position embedding, takes full logits, and scores each position's targets with
``F.cross_entropy`` per slot; the backward uses a random, non-unit upstream gradient.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.harness import run_distributed, tp_layer_config

V, H, B, T, S = 32, 16, 2, 6, 3


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    word = torch.randn(V, H, generator=g, dtype=torch.float64)
    pos = torch.randn(T, H, generator=g, dtype=torch.float64) * 0.5
    out = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.3
    return word, pos, out


def _sample(mode, seed):
    """x: [B, L + 1] tokens (L = S*T, or T in output mode) with repeats; loss mask with holes."""
    length = T if mode == "output" else S * T
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, V, (B, length + 1), generator=g)
    x[0, :S] = 5  # a bag of one repeated token
    mask = (torch.rand(B, length, generator=g) > 0.2).to(torch.float32)
    return x, mask


def _upstream(seed):
    g = torch.Generator().manual_seed(seed + 2)
    return float(torch.randn((), generator=g) * 2.0 + 1.5)


def _reference(mode, weighting, seed):
    """Float64 MCE, and its gradients times the upstream scalar, from the definitions."""
    word, pos, out = (w.clone().requires_grad_(True) for w in _weights(seed))
    x, mask = _sample(mode, seed)
    slots = 1 if mode == "input" else S
    w = (
        torch.ones(slots, dtype=torch.float64)
        if weighting == "uniform"
        else 1.0 / torch.arange(1, slots + 1, dtype=torch.float64)
    )
    w = w / w.sum()
    total = weight = torch.zeros((), dtype=torch.float64)
    for b in range(B):
        for j in range(T):
            inputs = (
                [int(x[b, j])] if mode == "output" else [int(x[b, j * S + m]) for m in range(S)]
            )
            hidden = word[inputs].mean(dim=0) + pos[j]
            logits = hidden @ out.t()
            for k in range(slots):
                i = j + 1 + k if mode == "output" else (j + 1) * S + k  # index into x
                if i >= x.shape[1] or mask[b, i - 1] == 0:
                    continue
                ce = F.cross_entropy(logits[None], x[b, i][None])
                total = total + w[k] * ce
                weight = weight + w[k]
    mce = total / weight
    (mce * _upstream(seed)).backward()
    return {"mce": mce.detach(), "word": word.grad, "pos": pos.grad, "out": out.grad}


CASES = [
    ("full", "uniform", True),
    ("input", "uniform", False),
    ("input", "power", True),
    ("output", "uniform", False),
    ("output", "power", True),
]


def _modes_child(rank, world, *, seed):
    """Every case of :data:`CASES` in one pair of processes (one spawn)."""
    from tst_megatron.runtime import ParallelConfig, initialize_model_parallel

    initialize_model_parallel(ParallelConfig(tensor_model_parallel_size=world))
    return {case: _mode_case(rank, world, *case, seed=seed) for case in CASES}


def _mode_case(rank, world, mode, weighting, sp, *, seed):
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )

    from tst_megatron.loop.forward import make_phase1_step
    from tst_megatron.runtime import set_seed
    from tst_megatron.superposition import vocab_parallel_multi_target_cross_entropy

    set_seed(seed)
    config = tp_layer_config(world, hidden_size=H, sequence_parallel=sp)
    word, pos, out = _weights(seed)
    shard = V // world
    mine = slice(rank * shard, (rank + 1) * shard)

    class Head(torch.nn.Module):
        """Embedding + vocab-parallel output layer, called like GPTModel in phase 1."""

        pre_process = True

        def __init__(self):
            super().__init__()
            self.embedding = LanguageModelEmbedding(
                config,
                vocab_size=V,
                max_sequence_length=T,
                position_embedding_type="learned_absolute",
            )
            self.output_weight = torch.nn.Parameter(out[mine].float().clone())
            with torch.no_grad():
                self.embedding.word_embeddings.weight.copy_(word[mine])
                self.embedding.position_embeddings.weight.copy_(pos)

        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None):
            assert input_ids is None
            if sp:  # as ColumnParallelLinear: all-gather the sequence, reduce-scatter its grad
                hidden = tensor_parallel.gather_from_sequence_parallel_region(
                    decoder_input, tensor_parallel_output_grad=True
                )
            else:  # identity forward, all-reduce of the grad
                hidden = tensor_parallel.copy_to_tensor_model_parallel_region(decoder_input)
            logits = hidden @ self.output_weight.t()  # [T, b, V/tp]
            if labels is None:  # batch-first logits, as GPTModel(labels=None)
                return logits.transpose(0, 1).contiguous()
            # [b, T, k] targets: per-slot CE, as the loss seam of models/gpt.py does it
            targets = labels.transpose(0, 1).contiguous()
            ce = vocab_parallel_multi_target_cross_entropy(logits, targets, tp_group=tp_group)
            return ce.transpose(0, 1).contiguous()

    tp_group = ps.get_tensor_model_parallel_group()
    model = Head()
    x, mask = _sample(mode, seed)
    batch = {"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": mask}
    step = make_phase1_step(bag_size=S, weighting=weighting, mode=mode)
    output, loss_func = step(iter([batch]), model)
    loss, count, report = loss_func(output)
    mce = loss / count  # the step's loss is MCE x count, whatever unit count has
    (mce * _upstream(seed)).backward()
    return {
        "mce": mce.detach(),
        "report": report["mce loss"],  # phase 1 reports under its own key
        "word": model.embedding.word_embeddings.weight.grad.clone(),
        "pos": model.embedding.position_embeddings.weight.grad.clone(),
        "out": model.output_weight.grad.clone(),
    }


@pytest.fixture(scope="module")
def tp2_runs():
    return run_distributed(_modes_child, 2, seed=11)


@pytest.mark.slow
@pytest.mark.parametrize("mode,weighting,sp", CASES)
def test_mode_tp2_matches_float64_reference(tp2_runs, mode, weighting, sp):
    seed = 11
    ref = _reference(mode, weighting, seed)
    shard = V // 2
    for rank, runs in enumerate(tp2_runs):
        got = runs[(mode, weighting, sp)]
        torch.testing.assert_close(got["mce"].double(), ref["mce"], rtol=1e-5, atol=1e-6)
        mine = slice(rank * shard, (rank + 1) * shard)
        for name, full in (("word", ref["word"][mine]), ("out", ref["out"][mine])):
            torch.testing.assert_close(got[name].double(), full, rtol=1e-4, atol=1e-6, msg=name)
        # position embeddings are replicated and added before the SP scatter: full grad on each rank
        torch.testing.assert_close(got["pos"].double(), ref["pos"], rtol=1e-4, atol=1e-6)
