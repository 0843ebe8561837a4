"""The launcher's forward step (:class:`tst_megatron.loop.forward.TSTForwardStep`) on a
model from its model provider, against a float64 reference written here: phase 1 is the
multi-hot cross-entropy of bag-averaged inputs, phase 2 and evaluation are next-token
cross-entropy. One process (spawned: Megatron-LM's globals stay out of pytest's process).
"""

from __future__ import annotations

import pytest

from tests.distributed.harness import reference_bag_ce, run_distributed

S, T, B, V = 2, 8, 2, 128
ARGS = [
    "--device", "cpu", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(V),
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", str(T), "--max-position-embeddings", str(T),
    "--micro-batch-size", str(B), "--global-batch-size", str(B), "--train-iters", "4",
    "--lr", "1e-3", "--eval-interval", "2", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7",
    "--tst-bag-size", str(S), "--tst-phase1-iters", "2",
]  # fmt: skip


def _reference_mce(logits, stream, mask):
    """float64 MCE: position j predicts tokens ``stream[(j+1)S + k]``, k < S, each scored
    when it exists and its label's mask is 1; the mean over scored slots."""
    terms, positions = reference_bag_ce(logits, stream, mask, S=S, T=T)
    return sum(float(ce) for ce in terms) / len(terms), positions


def _step_child(rank, world):
    import torch
    from megatron.core import mpu, tensor_parallel
    from megatron.training import get_args

    from tst_megatron.loop.forward import TSTForwardStep
    from tst_megatron.models.family import GPT
    from tst_megatron.training.validate import check_and_set_up

    plan = check_and_set_up(ARGS).plan
    mpu.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    model = GPT.model_provider()
    args = get_args()
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(0, V, (B, S * T + 1), generator=g)
    mask = torch.ones(B, S * T)
    mask[0, 5] = 0  # one masked label inside a bag
    phase1_batch = {"tokens": stream[:, :-1], "labels": stream[:, 1:], "loss_mask": mask}
    window = stream[:, : T + 1]
    phase2_batch = {
        "tokens": window[:, :-1],
        "labels": window[:, 1:],
        "loss_mask": torch.ones(B, T),
        "position_ids": torch.arange(T).expand(B, T),
    }
    step = TSTForwardStep(plan)

    def run(batch, iteration, training):
        args.curr_iteration = iteration
        model.train(training)
        with torch.no_grad():
            out, loss_func = step(iter([batch]), model)
            loss, n, report = loss_func(out)
        return float(loss) / int(n), int(n)

    results = {
        "phase1": run(phase1_batch, 1, True),
        "phase2": run(phase2_batch, 2, True),
        "eval_in_phase1": run(phase2_batch, 0, False),
    }
    # the references: the same weights, inputs built plainly
    model.eval()
    with torch.no_grad():
        emb = model.embedding
        bags = stream[:, :-1].reshape(B, T, S)
        x = emb.word_embeddings.weight[bags].mean(dim=2)  # [b, T, h]
        x = x + emb.position_embeddings.weight[:T][None]
        logits = model(None, None, None, decoder_input=x.transpose(0, 1).contiguous())
        results["ref_phase1"] = _reference_mce(logits, stream, mask)
        logits = model(window[:, :-1], phase2_batch["position_ids"], None).double()
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, V), window[:, 1:].reshape(-1))
        results["ref_phase2"] = (float(ce), B * T)
    return results


@pytest.mark.slow
def test_forward_step_phases_against_float64_references():
    (r,) = run_distributed(_step_child, 1)
    (got, n), (want, n_want) = r["phase1"], r["ref_phase1"]
    assert n == n_want
    assert got == pytest.approx(want, rel=1e-5)
    assert r["phase2"][1] == r["ref_phase2"][1]
    assert r["phase2"][0] == pytest.approx(r["ref_phase2"][0], rel=1e-5)
    # evaluate() runs next-token even at an iteration of phase 1 (the model is in eval mode)
    assert r["eval_in_phase1"][0] == pytest.approx(r["ref_phase2"][0], rel=1e-5)
