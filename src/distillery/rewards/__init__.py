"""The reward plugins that ship (run config: ``method.rewards.<name>._target_``; the interface is
:mod:`distillery.methods.rl.rewards`): :mod:`.adherence` (the synthetic clips' analyzer: colour, shape and direction read
back), :mod:`.clip` (CLIP text–video similarity from a CLIP folder) and :mod:`.preference` (an image classifier's
preference from a folder transformers loads). Nothing imports this package but a run config's ``_target_``."""
