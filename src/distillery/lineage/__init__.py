"""Artifact lineage: the sealed ``lineage.json`` manifests and their verification (:mod:`~distillery.lineage.manifest`),
hashed through the workspace hash cache that spares rereading unchanged files (:mod:`distillery.common.hashcache`,
shared with the training library)."""
