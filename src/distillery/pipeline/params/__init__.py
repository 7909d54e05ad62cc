"""Reading params.yaml: bounded and as DVC reads it (`file`), typed (`schema`, `reader`; a training section by the
recipe its `method` names, found in the workspace's registry: `recipes`), profiles (`profile`), the base it names
(`base_path`)."""
