"""Small shared helpers with no training or pipeline logic: errors, logging, progress, files, processes, offline mode."""
