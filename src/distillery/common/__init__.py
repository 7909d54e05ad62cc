"""Small shared helpers with no training or pipeline logic: errors, logging, progress, files, processes, offline mode,
the file-digest cache (`hashcache`) and video grids (`videogrid`) that the training library and the pipeline share."""
