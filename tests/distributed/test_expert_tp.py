"""Expert gradients under every expert layout equal the 1-process gradients.

An expert's gradient is the sum over the ranks that run it on some tokens. megatron-core
reduces an expert parameter over the data-parallel group when it is tagged ``allreduce``,
else over the expert data-parallel group, and sums a parameter tagged ``sequence_parallel``
over the TP group as well. Three layouts went wrong silently:

- expert-TP 1 < TP 2, EP 1 (``--expert-tensor-parallel-size 1`` under
  ``--tensor-model-parallel-size 2 --sequence-parallel``): each TP rank holds every expert
  whole and runs it on its own ``T/tp`` positions; megatron-core 0.16.1 tagged the experts
  for the DP group (size 1 here), so the two replicas kept half a gradient each and drifted;
- the same layout with biases: megatron-core (0.16.1 and 0.19) also sums the experts'
  second-layer bias over TP, on top of the expert-DP sum (twice the gradient on 0.19);
- TP 2 + SP with EP 2 and biases: that TP sum adds the bias gradient of *another* expert
  (the one the TP peer holds at the same local index).

Each run loads the same checkpoint, takes one phase-1 step's forward and backward through
the trainer (its DDP and ``finalize_model_grads``), and returns every expert parameter and
reduced gradient; each rank's must equal the 1-process ones (its experts, its shard).
"""

import re

import pytest
import torch

from tests.defaults import TEST_DEFAULTS
from tests.distributed.harness import run_distributed

E, F = 4, 12  # experts, expert FFN width
ARGV = [
    *TEST_DEFAULTS,
    "--mock-data",
    "--vocab-size",
    "128",
    "--make-vocab-size-divisible-by",
    "64",
    "--num-layers",
    "2",
    "--hidden-size",
    "16",
    "--num-attention-heads",
    "2",
    "--seq-length",
    "8",
    "--swiglu",
    "--untie-embeddings-and-output-weights",
    "--num-experts",
    str(E),
    "--moe-ffn-hidden-size",
    str(F),
    "--moe-router-topk",
    "2",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    "4",
    "--tst-bag-size",
    "2",
    "--tst-phase1-iters",
    "2",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--device",
    "cpu",
    "--seed",
    "7",
]  # biases on (Megatron-LM's default) unless a layout adds --disable-bias-linear

TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
LAYOUTS = {  # name: (flags, EP, expert-TP)
    "etp1_tp2_bias": (TP2 + ["--expert-tensor-parallel-size", "1"], 1, 1),
    "etp1_tp2_ep2_bias": (
        TP2 + ["--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2"],
        2,
        1,
    ),
    "etp2_tp1_dp2": (["--expert-tensor-parallel-size", "2", "--disable-bias-linear"], 1, 2),
}


def _expert_grads_child(rank, world, *, argv):
    """With ``--save``: save the fresh model as iteration 1; with ``--load``: load it. Then
    one phase-1 step's forward and backward; returns this rank's expert parameters and
    reduced gradients."""
    from tst_megatron.training import trainer
    from tst_megatron.training.config import parse_args

    run = trainer.setup(parse_args(argv))
    if run.cfg.checkpoint.save:
        trainer.save(run, 1, 0)
        iteration = 1
    else:
        iteration, _ = trainer.resume(run)
    phase = run.schedule.phase_at(iteration)
    assert phase.bag_size == 2  # a phase-1 step
    batches = trainer.read_batches(run, phase, phase.data_step(iteration))
    for chunk in run.model:
        chunk.zero_grad_buffer()
    trainer.run_schedule(run, phase, batches, forward_only=False)  # + finalize_model_grads
    params = {
        name: p for name, p in run.model[0].module.named_parameters() if ".mlp.experts." in name
    }
    return {
        "weight": {name: p.detach().clone() for name, p in params.items()},
        "grad": {name: p.main_grad.detach().clone() for name, p in params.items()},
    }


def _expected(full: dict, name: str, rank: int, ep: int, etp: int) -> torch.Tensor:
    """The 1-process tensor that local parameter ``name`` of ``rank`` holds: expert
    ``rank * E/ep + i`` for local expert ``i`` (EP over the ranks), and with expert TP its
    shard: rows of the gate and of the up half of fc1 (SwiGLU), columns of fc2."""
    i = int(re.search(r"local_experts\.(\d+)\.", name).group(1))
    first = rank * (E // ep) if ep > 1 else 0
    tensor = full[name.replace(f"local_experts.{i}.", f"local_experts.{first + i}.")]
    if etp == 1:
        return tensor
    cols = slice(rank * F // etp, (rank + 1) * F // etp)
    if "linear_fc1" in name:
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate[cols], up[cols]])
    return tensor[:, cols]


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_expert_gradients_equal_one_process(layout, tmp_path, capfd):
    flags, ep, etp = LAYOUTS[layout]
    base = ARGV + [f for f in flags if f == "--disable-bias-linear"]
    (one,) = run_distributed(_expert_grads_child, 1, argv=base + ["--save", str(tmp_path)])
    two = run_distributed(
        _expert_grads_child, 2, argv=ARGV + flags + ["--load", str(tmp_path), "--no-load-optim"]
    )
    if layout == "etp1_tp2_bias":  # the start-up line names the group the experts sum over
        assert "EP 1, ETP 1, DP 1, expert DP 2" in capfd.readouterr().out
    for rank, got in enumerate(two):
        assert len(got["grad"]) == 2 * (E // ep) * (2 if etp > 1 else 4)  # layers x experts x ...
        for name, grad in got["grad"].items():
            weight = _expected(one["weight"], name, rank, ep, etp)
            torch.testing.assert_close(got["weight"][name], weight, rtol=0, atol=0)
            want = _expected(one["grad"], name, rank, ep, etp)
            assert want.abs().max() > 0, name  # the expert received tokens
            torch.testing.assert_close(
                grad,
                want,
                rtol=1e-5,
                atol=1e-7,
                msg=lambda text, rank=rank, name=name: f"rank {rank}, {name}: {text}",
            )
