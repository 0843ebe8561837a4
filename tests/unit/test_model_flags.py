"""The RoPE flags reach the model the launcher builds.

Every model flag reaches the model as in Megatron-LM by construction: the launcher's
``model_provider`` builds the ``TransformerConfig`` and the ``GPTModel`` arguments with
Megatron-LM's own builders (``core_transformer_config_from_args``, ``gpt_config_from_args``).
The rotary flags are kept under test because they once were accepted, recorded in checkpoints
and silently not applied (``--rotary-percent 0.5`` and ``--rotary-seq-len-interpolation-factor
4`` gave bitwise the losses of a run without them): the RoPE table is compared with the
formula written out here, and the output must change.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("megatron.training")

#: A tiny GPT with RoPE on the local spec: kv channels 32 / 4 heads = 8.
BASE = [
    "--device", "cpu", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
    "--global-batch-size", "1", "--train-iters", "4", "--lr", "1e-3", "--eval-interval", "2",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--make-vocab-size-divisible-by", "8",
]  # fmt: skip

CASES = {
    "base": ([], 8, 1.0),
    "percent": (["--rotary-percent", "0.5"], 4, 1.0),
    "factor": (["--rotary-seq-len-interpolation-factor", "2"], 8, 2.0),
    "both": (["--rotary-percent", "0.5", "--rotary-seq-len-interpolation-factor", "4"], 4, 4.0),
}


def _inv_freq(dim, base):
    """RoPE frequencies, written plainly: ``base ** (-2i / dim)``, ``i < dim/2``."""
    return torch.tensor([base ** (-2 * i / dim) for i in range(dim // 2)], dtype=torch.float64)


def _rope_child(rank, world, *, cases):
    """For each case: Megatron-LM's arguments through the launcher's ``check_and_set_up``, the model of
    its ``model_provider`` with fixed weights; returns ``{name: (logits, RoPE table)}``."""
    from megatron.training.global_vars import unset_global_variables

    from tst_megatron.models.family import GPT
    from tst_megatron.runtime import ParallelConfig, initialize_model_parallel, set_seed
    from tst_megatron.training.validate import check_and_set_up

    initialize_model_parallel(ParallelConfig())
    set_seed(1)  # megatron-core's RNG tracker (read by the attention's dropout region)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(16).expand(2, 16)
    results = {}
    for name, (extra, _, _) in cases.items():
        check_and_set_up(BASE + extra)
        model = GPT.model_provider()
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):  # the same weights in every case
                g = torch.Generator().manual_seed(i)
                p.copy_((1.0 if p.dim() == 1 else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
        model.eval()
        with torch.no_grad():
            logits = model(tokens, positions, None)
        table = model.rotary_pos_emb(16).reshape(16, -1).double()  # [T, rotary dim]
        results[name] = (logits, table)
        unset_global_variables()
    return results


@pytest.mark.slow
def test_rotary_flags_change_the_rope_table_and_the_output():
    """The RoPE angle of position p, channel pair i is (p / factor) * base ** (-2i / dim),
    dim = int(kv_channels * rotary_percent) (megatron-core's ``RotaryEmbedding``); the logits
    differ from a model without the flags."""
    from tests.distributed.harness import run_distributed

    (results,) = run_distributed(_rope_child, 1, cases=CASES)
    base_logits, _ = results["base"]
    for name, (_, dim, factor) in CASES.items():
        logits, table = results[name]
        positions = torch.arange(16, dtype=torch.float64) / factor
        angles = torch.outer(positions, _inv_freq(dim, 10000))
        expected = torch.cat([angles, angles], dim=-1)
        torch.testing.assert_close(table, expected, rtol=1e-6, atol=1e-6, msg=name)
        assert math.isfinite(float(logits.abs().max())), name
        if name != "base":
            assert not torch.allclose(logits, base_logits, atol=1e-3), f"{name}: output unchanged"
