"""The models TST trains, below the launch layer (:mod:`tst_megatron.training`) and the
checkpoint converter (:mod:`tst_megatron.conversion`), which both import them and never the
other way:

- :mod:`.family`: one :class:`~tst_megatron.models.family.ModelFamily` per model family
  (``GPT``, ``HYBRID``: launcher, builder, model provider); their launch rules are the launch
  layer's (:data:`tst_megatron.training.checks.model.FAMILY_RULES`);
- :mod:`.gpt`: ``TSTGPTModel``, its local specs and builder; :mod:`.hybrid`:
  ``TSTHybridModel``, the local hybrid stack and its builder; :mod:`.layers`: the local layer
  pieces both share; :mod:`.seams`: the TST seams both model classes share;
- :mod:`.pattern`: ``--hybrid-layer-pattern`` and its layer symbols;
- :mod:`.report`: what a dry run says of the model (its ``model:`` line, Megatron-LM's parameter
  count and memory, one checkpoint's size).
"""
