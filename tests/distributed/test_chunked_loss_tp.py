"""The chunked output layer + cross-entropy at TP = 2 (2 gloo processes), with and without
sequence parallelism, against the 1-process float64 reference of
``tests/unit/test_chunked_loss.py``: each rank holds half the vocabulary rows of the weight
(and, with sequence parallelism, half the positions of the hidden states). The predictions
(MTP's acceptance counts) are the gathered logits' first argmax, ties across ranks included."""

from __future__ import annotations

import torch

from tests.distributed.harness import run_distributed

T, B, H, V, K = 8, 2, 6, 10, 3


def _inputs():
    g = torch.Generator().manual_seed(3)
    # multiples of 1/4: every logit is exact in float64, so equal rows tie exactly
    hidden = torch.round(torch.randn(T, B, H, generator=g, dtype=torch.float64) * 4) / 4
    weight = torch.round(torch.randn(V, H, generator=g, dtype=torch.float64) * 4) / 4
    targets = torch.randint(0, V, (T, B, K), generator=g)
    upstream = torch.rand(T, B, K, generator=g, dtype=torch.float64)
    upstream[5, 0] = 0.0
    weight[2] = weight[8] = 4 * weight[2]  # equal rows on both ranks: argmax ties across them
    return hidden, weight, targets, upstream


#: (sequence parallelism, chunks) of each case, all run in one pair of processes.
CASES = [(False, 1), (False, 3), (True, 1), (True, 3)]


def _child(rank, world):
    import torch.distributed as dist

    from tst_megatron.superposition.chunked_loss import chunked_output_cross_entropy

    hidden, weight, targets, upstream = _inputs()
    rows = V // world
    results = []
    for sequence_parallel, chunks in CASES:
        local_weight = weight[rank * rows : (rank + 1) * rows].clone().requires_grad_()
        if sequence_parallel:
            part = T // world
            local_hidden = hidden[rank * part : (rank + 1) * part].clone().requires_grad_()
        else:
            local_hidden = hidden.clone().requires_grad_()
        predictions = torch.full((T, B), -1, dtype=torch.int64)
        loss = chunked_output_cross_entropy(
            local_hidden, local_weight, targets, chunks=chunks, tp_group=dist.group.WORLD,
            sequence_parallel=sequence_parallel, predictions=predictions,
        )  # fmt: skip
        loss.backward(upstream)
        results.append((loss.detach(), local_hidden.grad, local_weight.grad, predictions))
    return results


def test_tp2_with_and_without_sequence_parallelism_equals_one_process():
    hidden, weight, targets, upstream = _inputs()
    hidden.requires_grad_()
    weight.requires_grad_()
    log_p = torch.log_softmax(hidden @ weight.t(), dim=-1)
    ref = -torch.gather(log_p, -1, targets)
    ref.backward(upstream)
    argmax = torch.argmax(hidden @ weight.t(), dim=-1)  # the first of equal maxima
    assert (argmax == 2).sum() >= 2  # the tie across the ranks is taken
    ranks = run_distributed(_child, world_size=2)
    rows = V // 2
    for rank, results in enumerate(ranks):
        for (sequence_parallel, chunks), result in zip(CASES, results):
            loss, grad_hidden, grad_weight, predictions = result
            case = (rank, sequence_parallel, chunks)
            assert torch.equal(predictions, argmax), case
            torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12, msg=str(case))
            torch.testing.assert_close(
                grad_weight, weight.grad[rank * rows : (rank + 1) * rows], rtol=1e-12,
                atol=1e-12, msg=str(case),
            )  # fmt: skip
            expected = hidden.grad
            if sequence_parallel:
                expected = expected[rank * (T // 2) : (rank + 1) * (T // 2)]
            torch.testing.assert_close(grad_hidden, expected, rtol=1e-12, atol=1e-12)
