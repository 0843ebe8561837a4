"""tst_megatron: Token Superposition Training (TST) for Megatron-Core GPT/MoE pretraining.

Subpackages:
  - :mod:`tst_megatron.superposition`: the method (bags, bag-averaged embedding, multi-hot CE).
  - :mod:`tst_megatron.runtime`: process start-up (torch.distributed, model parallel, seeds),
    the CPU/gloo redirection of megatron-core's CUDA assumptions, the SP-capable norm.
  - :mod:`tst_megatron.training`: the pretrain_gpt-style trainer with the phase switch.
  - :mod:`tst_megatron.data`: corpus, SentencePiece tokenizer, Megatron .bin/.idx datasets.
  - :mod:`tst_megatron.plots`: loss plots from TensorBoard events.
"""

__version__ = "0.1.0"
