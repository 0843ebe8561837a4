"""TST inside Megatron-LM's own training loop (``megatron.training.pretrain()``).

- :mod:`.megatron_lm`: the launcher: ``--tst-*`` flags, the model, dataset and forward-step
  providers, the TST checks, the switch's checkpoint, validation and log line;
- :mod:`.dry_run`: ``--dry-run`` (Megatron-LM's validation and the TST checks, no processes);
- :mod:`.gpt`: ``TSTGPTModel`` (a ``GPTModel`` with the TST loss seam);
- :mod:`.model`: local layer specs and ``build_gpt_model``;
- :mod:`.data`: datasets and the phase-aware TST sample stream;
- :mod:`.forward`: the forward-step functions of both phases;
- :mod:`.fp8`: FP8 shape rules from the model's ``TransformerConfig``;
- :mod:`.fields`: command-line flags from dataclass fields.
"""

from tst_megatron.training.model import build_gpt_model, gpt_block_spec

__all__ = ["build_gpt_model", "gpt_block_spec"]
