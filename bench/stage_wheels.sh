#!/usr/bin/env bash
# Wheels the stages import on the GPU machine that its image lacks (no network there), beside what
# ../shared/tools/device-wheels.sh prepares (.whl/: diffusers and FlashAttention-4; .whl-parts/01–03: CUTLASS):
#   .whl-parts/04/  PyAV (validate's and the clips' video codec), one wheel of ≈ 34 MiB
#   .whl-parts/05/  MLflow's closure (tracking into a local sqlite store), ruamel.yaml and lazy_importer, ≈ 35 MiB
#                   (device-wheels.sh takes the newest importlib_metadata, 10.2.0, which imports lazy_importer; without
#                   it `import mlflow` fails there: seen 2026-12-02)
# Each piece is a folder small enough to travel with the project tree (64 MiB a call). Send them like the others:
# a `run` with carry [".whl-parts/NN"] and `mkdir -p /tmp/parts && cp .whl-parts/NN/* /tmp/parts/`, before the
# call that sources device-env.sh. What the image already holds (its package list: the device tool's KINDS.md)
# is left out; the versions are this repository's environment's (.venv), so the GPU runs what the tests ran.
# Usage (repository root, on a machine with the package registry): bash bench/stage_wheels.sh
set -euo pipefail
version() { .venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv/bin/python -m pip download -q --only-binary :all: --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$work" "mlflow==$(version mlflow)" "av==$(version av)" "ruamel.yaml==$(version ruamel.yaml)" \
  "ruamel.yaml.clib==$(version ruamel.yaml.clib)" "lazy_importer==0.1.0" 2>&1 | grep -v "is ignored" || true
mkdir -p .whl-parts/04 .whl-parts/05
for d in /.whl/ /.whl-parts/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
.venv/bin/python - "$work" <<'PY'
import os, re, shutil, sys
def project(name):  # a wheel's project name, normalised
    return re.sub(r"[-_.]+", "-", name.split("-")[0]).lower()
# on the GPU image (KINDS.md, "Python packages already there", read 2026-11-17) or carried in .whl/
image = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
charset-normalizer click cloudpickle colorama contourpy cycler filelock fonttools frozenlist fsspec grpcio h11
hf-xet httpcore httpx huggingface-hub idna imageio jinja2 joblib kiwisolver markdown markdown-it-py markupsafe
matplotlib mdurl multidict narwhals networkx numpy packaging pandas pillow prometheus-client propcache protobuf
psutil pyarrow pygments pyparsing python-dateutil pyyaml regex requests rich safetensors scikit-learn scipy
setuptools shellingham six tabulate threadpoolctl tokenizers torch tqdm transformers typer typing-extensions
urllib3 werkzeug wheel wrapt yarl zipp importlib-metadata diffusers""".split()
skip = set(image)
if os.path.isdir(".whl"):
    skip |= {project(f) for f in os.listdir(".whl") if f.endswith(".whl")}
for folder in (".whl-parts/04", ".whl-parts/05"):
    for f in os.listdir(folder):
        os.remove(os.path.join(folder, f))
for f in sorted(os.listdir(sys.argv[1])):
    if f.endswith(".whl") and project(f) not in skip:
        shutil.copy(os.path.join(sys.argv[1], f), ".whl-parts/04" if project(f) == "av" else ".whl-parts/05")
for folder in (".whl-parts/04", ".whl-parts/05"):
    names = os.listdir(folder)
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in names) / 2**20
    print(f"{folder}: {len(names)} wheels, {size:.1f} MiB")
PY
