#!/usr/bin/env bash
# Wheels for running `dvc repro` on the GPU machine (no network there): DVC's dependency closure for CPython 3.12 on
# manylinux x86_64, less what the machine already has or gets from the other pieces (.whl/, .whl-parts/04–06), into
# .whl-parts/07/ (≈ 20 MiB, one piece). Send it like the others: a `run` with carry [".whl-parts/07"] and
# `mkdir -p /tmp/parts && cp .whl-parts/07/* /tmp/parts/` before the call that sources device-env.sh.
# Usage (from the repository root, on a machine with the package registry): bash bench/dvc_wheels.sh
set -euo pipefail
DVC_VERSION=${DVC_VERSION:-$(.venv/bin/dvc --version)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pip=(.venv/bin/python -m pip)
"${pip[@]}" wheel -q --no-deps -w "$work" "antlr4-python3-runtime==4.9.3"  # hydra-core's: published as a source archive only
"${pip[@]}" download -q "dvc==$DVC_VERSION" --only-binary :all: --find-links "$work" --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$work"
mkdir -p .whl-parts/07
.venv/bin/python - "$work" <<'PY'
import os, re, shutil, sys
def project(name):  # a wheel's project name, normalised
    return re.sub(r"[-_.]+", "-", name.split("-")[0]).lower()
# carried already, or on the image (torch, diffusers and MLflow import them there)
skip = {"filelock", "fsspec", "networkx", "packaging", "setuptools", "typing-extensions", "tqdm", "requests", "urllib3",
        "idna", "certifi", "charset-normalizer", "pyyaml"}
for folder in (".whl", ".whl-parts/04", ".whl-parts/05", ".whl-parts/06"):
    if os.path.isdir(folder):
        skip |= {project(f) for f in os.listdir(folder) if f.endswith(".whl")}
kept = [f for f in sorted(os.listdir(sys.argv[1])) if f.endswith(".whl") and project(f) not in skip]
for f in kept:
    shutil.copy(os.path.join(sys.argv[1], f), ".whl-parts/07/")
size = sum(os.path.getsize(os.path.join(".whl-parts/07", f)) for f in kept) / 2**20
print(f".whl-parts/07: {len(kept)} wheels, {size:.1f} MiB")
PY
