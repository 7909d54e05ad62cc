"""Writes ``student_sample.npz`` beside this file: one decoded video of a tiny student — the 1-step ``few_step_x0``
sampler on the shipped tiny base, as ``tests/test_clip_scores.py``'s ``student_1``, sampled and decoded by validate —,
its first 9 frames ×4 nearest-upsampled to 128×128 (RAFT's and AMT's correlation pyramids need 121+ pixels a side).

Usage (the project's venv): ``python tests/vbench_faithfulness/make_student_sample.py``; then rerun make_reference.py.
"""
import json
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from distillery.evaluation.candidates import Candidate
from distillery.evaluation.sample_cache import SampleCache
from distillery.evaluation.validate import run_validation
from distillery.evaluation.validation_config import ValidationConfig
from distillery.tinybase.shipped import shipped_tiny_base

root = Path(tempfile.mkdtemp())
base = shipped_tiny_base()
cand = Candidate("student_1", base, 1, 1.0, "few_step_x0")
cache = SampleCache(root / "cache")
cfg = ValidationConfig(num_seeds=1, progress_bar=False, grid_formats=["gif"], bootstrap_resamples=0)
run_validation(base, [cand], ["a red circle moving left slowly on a black background"], root / "v", cfg, cache=cache)
report = json.loads((root / "v" / "report.json").read_text())
frames = load_file(str(cache.root / report["cache"]["student_1"]["key"] / "frames.safetensors"))
v = frames["0"][:9].repeat(4, axis=1).repeat(4, axis=2)
assert v.dtype == np.uint8 and v.shape == (9, 128, 128, 3)
np.savez_compressed(Path(__file__).resolve().parent / "student_sample.npz", frames=v)
print(v.shape, float(v.mean()))
