"""Base models the pipeline starts from: the tiny Wan 2.1 the project makes itself (:mod:`.tiny`, its tokenizer
:mod:`.tokenizer`, the fitted one shipped in the package :mod:`.shipped`).

Nothing is imported here: finding the shipped base (``params.yaml: base.path: tiny``, the base stage's input and its
preflight's size estimate) imports only :mod:`.shipped`, so the base stage's code deps are not the modules that build
a tiny base, which it never runs."""
