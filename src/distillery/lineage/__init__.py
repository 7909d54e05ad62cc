"""Artifact lineage: the sealed ``lineage.json`` manifests and their verification (:mod:`~distillery.lineage.manifest`),
and the hash cache that spares rereading unchanged files (:mod:`~distillery.lineage.hashcache`)."""
