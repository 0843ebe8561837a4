"""A lean ``pretrain_gpt``-style trainer from megatron-core parts, with the TST switch.

- :mod:`.config`: flags (generated from one dataclass per concern) and validation;
- :mod:`.model`: the ``GPTModel`` (local or Transformer Engine spec);
- :mod:`.data`: datasets and the TST training stream;
- :mod:`.forward`: the forward-step functions of both phases;
- :mod:`.checkpointing`: ``torch_dist`` checkpoints;
- :mod:`.trainer`: set-up and the loop (``main`` is the CLI entry).
"""

from tst_megatron.training.model import build_gpt_model, gpt_block_spec

__all__ = ["build_gpt_model", "gpt_block_spec"]
