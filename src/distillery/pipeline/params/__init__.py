"""Reading params.yaml: bounded and as DVC reads it (`file`), typed (`schema`, `reader`), profiles (`profile`),
the base it names (`base_path`), and the checks before a stage works (`preflight`)."""
