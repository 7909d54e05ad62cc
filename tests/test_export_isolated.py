"""Every kind of export (the teacher, a Self-Forcing student, a DMD2 student, a PDD student) loads and
samples where distillery is NOT installed, and reproduces the latents validate saved for it; the
snippets of each export's own model card run there too, and return validate's video.

The exports are made by the export stage's own assembly (:func:`stages.export.assemble_export`
and the card, :func:`distillery.export.model_card.export_model_card`) from the shipped tiny Wan and
hand-made student folders (its transformer under each kind's ``sampling.json``; the PDD one with a head
bank), after one :func:`~distillery.evaluation.validate.run_validation` over all of them (one prompt,
one seed): no training, seconds. The isolated process (``python -I``, its working folder outside the
checkout) runs in a virtual environment holding exactly the packages the cards name ("needs only ..."),
each at the version this project's venv has (so pip installs them from the machine's wheels, offline),
and what they depend on — nothing else, distillery least of all (it first proves ``import distillery``
fails there): :func:`card_venv`, built once and kept under ``~/.cache/distillery-tests/``, keyed by the
pins (under a minute the first time). A package the export needs and the card leaves out fails here, as
it fails for a user who installs what the card says.

There too, stock loading: ``WanPipeline.from_pretrained`` loads the teacher's export (a stock Wan model) and
refuses every student's (its ``model_index.json`` names the folder's own pipeline: diffusers asks for
``trust_remote_code``, naming ``pipeline.py``) — it must never sample a student with the teacher's loop —, and
with ``trust_remote_code=True`` any loader gives the folder's ``DistilledWanPipeline``.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distillery.tinybase.shipped import shipped_tiny_base

pytestmark = pytest.mark.slow  # one subprocess loading four exports

PROMPT = "a red circle moving left on a black background"
STUDENTS = {  # name -> (sampling.json, head bank?)
    "teacher": ({"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000}, False),
    "distill": ({"sampler": "causal_streaming", "shift": 3.0, "num_train_timesteps": 1000, "timesteps": [1000.0, 600.0],
                 "chunk_size": 2, "context_noise": 0.0, "renoise": "sde"}, False),
    "dmd2": ({"sampler": "few_step_x0", "shift": 3.0, "num_train_timesteps": 1000, "timesteps": [1000.0, 500.0]}, False),
    "pdd": ({"sampler": "pdd_fused", "shift": 3.0, "num_train_timesteps": 1000, "pdd_steps": 4, "block_size_max": 4,
             "num_steps": 2, "guidance_scale": 1.0}, True),
}


def _student(root: Path, name: str, contract: dict, heads: bool) -> Path:
    """``root/<name>``: an artifact as a training stage leaves it (``model/transformer``, ``model/sampling.json``,
    a sealed lineage.json), over the tiny Wan's transformer."""
    from safetensors.torch import load_file, save_file

    from distillery.lineage.manifest import write_lineage

    folder = root / name
    shutil.copytree(shipped_tiny_base() / "transformer", folder / "model" / "transformer")
    (folder / "model" / "sampling.json").write_text(json.dumps(contract, indent=2))
    if heads:
        weights = load_file(str(folder / "model" / "transformer" / "diffusion_pytorch_model.safetensors"))
        w, b = weights["proj_out.weight"].float(), weights["proj_out.bias"].float()
        gen = torch.Generator().manual_seed(7)
        save_file({"weight": torch.stack([w + 0.05 * torch.randn(w.shape, generator=gen) for _ in range(4)]),
                   "bias": torch.stack([b + 0.05 * torch.randn(b.shape, generator=gen) for _ in range(4)])},
                  str(folder / "model" / "transformer" / "pdd_heads.safetensors"))
    write_lineage(folder, kind="model", stage=name, method=f"distillery.methods.{name}")
    return folder


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict:
    """``{"validate": report folder, "exports": {kind: export folder}}``."""
    from distillery.data.encoders import read_max_sequence_length
    from distillery.evaluation.candidates import Candidate
    from distillery.evaluation.validate import run_validation
    from distillery.evaluation.validation_config import ValidationConfig
    from distillery.export.code import CODE_RECORD_KEY
    from distillery.export.model_card import export_model_card
    from distillery.lineage.manifest import write_lineage
    from distillery.lineage.verify import verify_lineage
    from stages.export import assemble_export

    root = tmp_path_factory.mktemp("exports")
    base = shipped_tiny_base()
    students = {name: _student(root / "artifacts", name, *spec) for name, spec in STUDENTS.items()}
    candidates = [Candidate("teacher_2", students["teacher"] / "model", 2, 4.0, "euler"),
                  *(Candidate.from_artifact(f"{n}_2", students[n] / "model") for n in ("distill", "dmd2", "pdd")),
                  Candidate.from_artifact("pdd_1", students["pdd"] / "model", num_steps=1)]
    cfg = ValidationConfig(prompts=[PROMPT], num_frames=9, height=16, width=16, num_seeds=1, grid_formats=[],
                           bootstrap_resamples=0, progress_bar=False, max_sequence_length=16)
    validate = root / "artifacts" / "validate"
    run_validation(base, candidates, [], validate / "report", cfg)
    out = {}
    for name, student in students.items():
        folder = root / "exports" / name
        folder.mkdir(parents=True)
        code, stock_nfe = assemble_export(base, student / "model", folder)
        (folder / "README.md").write_text(export_model_card(name, student, validate, read_max_sequence_length(base),
                                                            stock_nfe, folder=str(folder)))
        write_lineage(folder, kind="export", stage="export", config={CODE_RECORD_KEY: code})
        assert verify_lineage(folder).ok, verify_lineage(folder).problems  # the shipped code is what it recorded
        out[name] = folder
    return {"validate": validate / "report", "exports": out}


VENV_CACHE = Path.home() / ".cache" / "distillery-tests" / "card-venvs"


def card_packages(card: str) -> list[str]:
    """The packages a model card says its snippets need: the distribution names of its "needs only a, b and c"."""
    found = re.search(r"needs only ([^)\n]+)", card)
    assert found, "the card does not say what its snippets need"
    return [name.strip(" `.") for name in re.split(r",| and ", found.group(1)) if name.strip(" `.")]


def card_video_packages(card: str) -> list[str]:
    """The packages a model card says saving the video as an mp4 takes: its "`pip install a b` to save the video"."""
    found = re.search(r"`pip install ([^`]+)` to save the video", card)
    assert found, "the card does not say what saving the video needs"
    return found.group(1).split()


def card_venv(packages: list[str]) -> Path:
    """The python of a venv holding exactly ``packages`` (and what they depend on), each pinned to the version this
    venv has; built once per set of pins (under a lock: two test processes build it once) and reused."""
    pins = sorted(f"{name}=={importlib.metadata.version(name).split('+')[0]}" for name in packages)
    folder = VENV_CACHE / hashlib.sha256(" ".join(pins).encode()).hexdigest()[:16]
    python = folder / "bin" / "python"
    VENV_CACHE.mkdir(parents=True, exist_ok=True)
    with open(VENV_CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "pins.txt").is_file() and (folder / "pins.txt").read_text().split() == pins and python.is_file():
            return python
        shutil.rmtree(folder, ignore_errors=True)
        building = folder.with_name(folder.name + ".building")
        shutil.rmtree(building, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(building)], check=True, capture_output=True, timeout=300)
        # --no-compile: pip would byte-compile every file of torch & co. (half the build); the isolated run compiles
        # only what it imports, once (its __pycache__ stays in the cached venv)
        pip = subprocess.run([str(building / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", *pins], capture_output=True,
                             text=True, timeout=1200, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
        assert pip.returncode == 0, pip.stderr[-3000:]
        (building / "pins.txt").write_text("\n".join(pins) + "\n")
        building.rename(folder)  # the venv's scripts name its path: python is run as folder/bin/python, never via them
        return python


ISOLATED = r'''
import json, sys
try:
    import distillery
    print("DISTILLERY_IMPORTED", distillery.__file__)
except ModuleNotFoundError:
    print("no distillery here")
import torch
from diffusers import DiffusionPipeline, WanPipeline
from safetensors.torch import load_file

report = json.load(open(REPORT + "/report.json"))
cands = {c["name"]: c for c in report["candidates"]}
cfg = report["config"]
kw = dict(num_frames=cfg["num_frames"], height=cfg["height"], width=cfg["width"],
          max_sequence_length=report["max_sequence_length"])
prompt, seed = report["prompts"][0], report["seeds"][0]
for kind, folder in EXPORTS.items():
    pipe = DiffusionPipeline.from_pretrained(folder, custom_pipeline=folder, trust_remote_code=True)
    print("class", kind, type(pipe).__name__, type(pipe).__module__)
    try:  # stock loading, as a user who never read the card would
        print("stock", kind, "loaded", type(WanPipeline.from_pretrained(folder)).__name__)
    except ValueError as exc:
        print("stock", kind, "refused", str(exc).splitlines()[0])
    print("trusted", kind, type(DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)).__name__,
          type(WanPipeline.from_pretrained(folder, trust_remote_code=True)).__name__)
    for name, c in cands.items():
        if not name.startswith(kind + "_"):
            continue
        saved = load_file(f"{REPORT}/samples/{name}/latents.safetensors")["0"]
        if c["sampler"] != json.load(open(folder + "/sampling.json"))["sampler"]:
            continue
        out = pipe(prompt, generator=torch.Generator().manual_seed(seed), output_type="latent", **kw,
                   num_inference_steps=c["num_steps"], guidance_scale=c["guidance_scale"]).frames[0]
        print("latents", kind, name, (out - saved).abs().max().item())
    print("plan", kind, pipe.speed_plan.stock, pipe.speed_plan.attention, pipe.speed_plan.decode)
    card = open(folder + "/README.md").read()
    for i, snippet in enumerate(card.split("```python\n")[1:]):
        snippet = snippet.split("```")[0]
        name = re.search(r"# validate's (\S+)", snippet).group(1)
        space = {}
        exec(snippet, space)
        saved = load_file(f"{REPORT}/samples/{name}/latents.safetensors")["0"]
        reference = pipe.decode_latents(saved[None], output_type="np")[0]
        print("snippet", kind, i, type(space["pipe"]).__name__, name, float(abs(space["video"] - reference).max()))
'''


def test_every_export_kind_samples_validate_s_latents_without_distillery(exports, tmp_path):
    packages = card_packages((exports["exports"]["teacher"] / "README.md").read_text())
    for folder in exports["exports"].values():  # every card names the same packages
        assert card_packages((folder / "README.md").read_text()) == packages, folder
    python = card_venv(packages + card_video_packages((exports["exports"]["teacher"] / "README.md").read_text()))
    code = f"import re\nREPORT = {str(exports['validate'])!r}\n" \
           f"EXPORTS = {json.dumps({k: str(v) for k, v in exports['exports'].items()})}\n" + ISOLATED
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([str(python), "-I", "-c", code], capture_output=True, text=True, timeout=600, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "no distillery here" in lines and not any("DISTILLERY_IMPORTED" in ln for ln in lines), out.stdout
    classes = [ln.split() for ln in lines if ln.startswith("class ")]
    assert [c[1:3] for c in classes] == [[k, "DistilledWanPipeline"] for k in STUDENTS], classes
    # stock WanPipeline loads the teacher (a stock Wan model); a student that needs its own sampler it refuses, naming
    # the pipeline.py its model_index.json names — and with trust_remote_code any loader gives the folder's pipeline
    stock = {ln.split()[1]: ln.split(maxsplit=3)[2:] for ln in lines if ln.startswith("stock ")}
    assert stock["teacher"] == ["loaded", "WanPipeline"], stock
    for kind in ("distill", "dmd2", "pdd"):
        assert stock[kind][0] == "refused" and "custom code in pipeline.py" in stock[kind][1], stock
    trusted = {ln.split()[1]: ln.split()[2:] for ln in lines if ln.startswith("trusted ")}
    assert trusted == {"teacher": ["WanPipeline", "WanPipeline"],
                       **{k: ["DistilledWanPipeline", "DistilledWanPipeline"] for k in ("distill", "dmd2", "pdd")}}, trusted
    latents = {ln.split()[2]: float(ln.split()[3]) for ln in lines if ln.startswith("latents ")}
    assert set(latents) == {"teacher_2", "distill_2", "dmd2_2", "pdd_2", "pdd_1"}, out.stdout
    assert max(latents.values()) <= 1e-5, latents
    snippets = [ln.split() for ln in lines if ln.startswith("snippet ")]
    # each card's snippets: the custom pipeline's, and stock WanPipeline's for the teacher and the fused PDD student
    assert [(s[1], s[3], s[4]) for s in snippets] == [
        ("teacher", "DistilledWanPipeline", "teacher_2"), ("teacher", "WanPipeline", "teacher_2"),
        ("distill", "DistilledWanPipeline", "distill_2"), ("dmd2", "DistilledWanPipeline", "dmd2_2"),
        ("pdd", "DistilledWanPipeline", "pdd_2"), ("pdd", "WanPipeline", "pdd_1")], out.stdout
    assert max(float(s[5]) for s in snippets) <= 1e-4, snippets
    # on the CPU every export samples on the stock path (its GPU parts stay off) and each pipeline (the card snippets'
    # too) says so in one line on stderr, on its first video
    plans = [ln.split()[1:] for ln in lines if ln.startswith("plan ")]
    assert plans == [[k, "True", "sdpa", "stock"] for k in STUDENTS], plans
    said = [ln for ln in out.stderr.splitlines() if ln.startswith("distilled Wan pipeline:")]
    assert len(said) == len(STUDENTS) + sum(s[3] == "DistilledWanPipeline" for s in snippets), said
    assert all("stock path" in ln and "needs CUDA" in ln for ln in said), said


def test_the_cards_say_what_each_export_is(exports):
    """The teacher's card is the teacher's (not "the `teacher` student"), with the guidance validate used; the
    streaming student's explains its NFE per chunk and per video; no latency without its machine and load."""
    cards = {k: (v / "README.md").read_text() for k, v in exports["exports"].items()}
    assert "\n# The teacher, exported by distillery\n" in cards["teacher"]
    assert "`teacher` student" not in cards["teacher"]
    assert "guidance_scale=4.0,  # validate's teacher_2" in cards["teacher"]
    assert "WanPipeline.from_pretrained(" in cards["teacher"] and "num_inference_steps=2, guidance_scale=4.0" in cards["teacher"]
    assert re.search(r"3 forwards per chunk, 2 × 2 \+ 1 = 5 per video", cards["distill"]), cards["distill"]
    for name, card in cards.items():
        if "trust_remote_code=True" in card:  # it runs the folder's pipeline.py: the card says to verify it first
            verify = card.index(" --verify --expect ")
            assert "distillery lineage " in card and verify < card.index("trust_remote_code=True)"), name
        assert "latency" not in card.split("## Validation")[1].split("\n\n")[1]  # the table has no latency column
        assert "Latencies are left out" in card
        assert "needs the `distillery`" not in card


def test_the_export_metrics_say_what_they_count(exports):
    from stages.export import export_metrics

    validate = exports["validate"].parent
    got = {k: export_metrics(k, v, validate, 1 if k == "pdd" else None) for k, v in exports["exports"].items()}
    assert got["teacher"] == {"is_teacher": 1, "nfe_per_video": 4}  # 2 steps × 2 (CFG 4.0), as validate sampled it
    assert got["distill"] == {"is_teacher": 0, "nfe_per_video": 5, "nfe_per_chunk": 3}  # 2 chunks × 2 steps + 1 write
    assert got["dmd2"] == {"is_teacher": 0, "nfe_per_video": 2}
    assert got["pdd"] == {"is_teacher": 0, "nfe_per_video": 2, "stock_nfe": 1}


def test_every_file_of_an_export_follows_the_umask(exports):
    """safetensors writes 0600 (the fused PDD transformer, the head bank); the export is as readable as the umask says."""
    import os

    mask = os.umask(0o022)
    os.umask(mask)
    for folder in exports["exports"].values():
        modes = {p.relative_to(folder).as_posix(): p.stat().st_mode & 0o777 for p in folder.rglob("*") if p.is_file()}
        wrong = {k: oct(m) for k, m in modes.items() if m != 0o666 & ~mask}
        assert not wrong, wrong
