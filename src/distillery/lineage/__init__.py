"""Artifact lineage: the sealed ``lineage.json`` manifests (:mod:`~distillery.lineage.manifest`: write, seal, read,
shape), the hashing of their files (:mod:`~distillery.lineage.hashing`), the code an artifact may carry
(:mod:`~distillery.lineage.artifact_code`), their verification (:mod:`~distillery.lineage.verify`, with the DVC outs
it cross-checks: :mod:`~distillery.lineage.dvc_outs`) and their rendering as a tree
(:mod:`~distillery.lineage.render`); the names they share live in :mod:`~distillery.lineage.contract`. Files are
hashed through the workspace hash cache that spares rereading unchanged files (:mod:`distillery.common.hashcache`,
shared with the training library)."""
