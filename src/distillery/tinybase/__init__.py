"""Base models the pipeline starts from: the tiny Wan 2.1 the project makes itself (:mod:`.tiny`, its tokenizer
:mod:`.tokenizer`, the fitted one shipped in the package :mod:`.shipped`).

Nothing is imported here: finding the shipped base (``params.yaml: base.path: tiny``, read by every stage's
preflight) must not import transformers and torch, which building a tiny base needs."""
