"""VBench's quality dimensions and quality score, computed the way VBench 0.1.5 computes them (our own code; its
prompt suite and normalisation constants are data, their sources named where they are used).

- the models, from folders the user names: :mod:`.models` (checks, digests, loading) over transformers' ViT/CLIP
  classes (:mod:`.dino`) and our modules of the published architectures (:mod:`.raft`, :mod:`.amt`, :mod:`.musiq`,
  :mod:`.viclip` with :mod:`.bpe`);
- the frames each dimension reads and how: :mod:`.frames`;
- the dimensions of one video: :mod:`.consistency` (subject, background, temporal flickering), :mod:`.motion`
  (motion smoothness, dynamic degree), :mod:`.appearance` (aesthetic, imaging quality), :mod:`.overall` (overall
  consistency); over many videos: :mod:`.dimensions`;
- the scores: :mod:`.score` (normalisation, weights, the published rows); the protocol: :mod:`.protocol`;
- a run and its report: :mod:`.run`, :mod:`.report` (``distillery vbench``).

How each formula was checked against vbench 0.1.5's own code: ``docs/vbench.md``.
"""
