"""Scoring candidates: the validate stage's sampling and metrics (:mod:`~distillery.evaluation.validate`), its
summary and plots, KID and the video metrics, and the cache of samples it reuses."""
