"""Running a stage: `runner` (`distillery stage NAME`), the checks before it works (`preflight`), what a recipe builds a
training stage's run config from and the checks of it (`run_config`), its run folder (`run_folder`) and resume key
(`resume_key`), its torchrun agents (`launcher`); `device` for one-process stages."""
