"""Reward-driven post-training (the RL family): :mod:`.nft` (DiffusionNFT, a ``_target_`` of a run config's
``method``), its arithmetic (:mod:`.objective`: advantages, clipping, the objective, the old policy's decay), where a
policy is trained (:mod:`.policy`: the timesteps and velocity of its sampling contract), the reward interface
(:mod:`.rewards`; the shipped rewards are :mod:`distillery.rewards`); its old policy and reference are shadow weights
(:mod:`distillery.components.shadow`). Nothing outside imports it but a run config's ``_target_``: a
training stage's code deps do not list it until a stage runs it."""
