"""The loop plug-in: what TST hands Megatron-LM's training loop (``megatron.training.pretrain()``),
below the launch layer (:mod:`tst_megatron.training`), which builds and passes them:

- :mod:`.plan`: the run plan (train iterations, consumed samples, ``N1``, the switch sample),
  built once per launch from Megatron-LM's arguments (:func:`~.plan.tst_config` reads the
  ``--tst-*`` settings);
- :mod:`.datasets`: the datasets provider (the data themselves: :mod:`tst_megatron.data`);
- :mod:`.forward`: the forward step of both phases; :mod:`.switch`: the switch at ``N1``.
"""
