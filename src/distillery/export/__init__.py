"""The export: a checkpoint role's weights as a diffusers folder (:mod:`~distillery.export.weights`), the code the
folder ships (:mod:`~distillery.export.code`, :mod:`~distillery.export.standalone`) and its model card
(:mod:`~distillery.export.model_card`)."""
