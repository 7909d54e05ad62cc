"""The posttrain stage's recipes (``posttrain.method``): reward-driven post-training of a few-step student (the distill
or the PDD stage's: ``posttrain.student``) on rollouts of its own. ``nft`` is DiffusionNFT
(:mod:`distillery.methods.rl.nft`). The stage is off unless ``posttrain.enabled``."""
