"""Publishing a stage's work: atomic artifacts and their lineage (`artifacts`), the MLflow parent run (`mlflow_runs`),
a training run's summary (`run_summary`), what a model folder may carry in (`base_folder`, `model_files`)."""
