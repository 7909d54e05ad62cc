"""Scoring candidates: the validate stage's sampling and metrics (:mod:`~distillery.evaluation.validate`), each
video's scores and their summaries (:mod:`~distillery.evaluation.video_scores`), the files it writes besides its
samples (:mod:`~distillery.evaluation.validation_files`), its summary and plots, KID and the video metrics, and the
cache of samples it reuses."""
