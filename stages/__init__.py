"""The pipeline's stage layer: one adapter module per stage of ``dvc.yaml`` and the training stages' recipes
(``stages/recipes/``, ``stages/README.md``), thin over the library and :mod:`distillery.pipeline` (params, launch,
publish).

``distillery stage <name>`` (:mod:`distillery.pipeline.launch.runner`) imports the one module its stage names from this
package, found in the workspace (the folder holding ``dvc.yaml`` and ``params.yaml``), as ``flows/`` is the Prefect face
imported from the repository root. No DVC or Prefect import here: DVC calls these stages, and the Prefect flows call DVC.
"""
