"""Running a stage: `runner` (`distillery stage NAME`), the training stages' table (`training_table`), their run
configs (`run_config`), resume keys (`resume_key`) and torchrun agents (`launcher`); `device` for one-process stages."""
