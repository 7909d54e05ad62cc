"""Crash-resume checkpoints: :mod:`.manager` (save/load/prune), :mod:`.host_state` (JSON + safetensors
host and RNG state), :mod:`.checksums` (size + sha256 of every file), :mod:`.dcp_io` (DCP read without
unpickling), :mod:`.trust` (which checkpoint a run may resume or export)."""
