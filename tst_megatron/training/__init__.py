"""Training from megatron-core parts. For now: model construction (:mod:`.model`)."""

from tst_megatron.training.model import build_gpt_model, gpt_block_spec

__all__ = ["build_gpt_model", "gpt_block_spec"]
