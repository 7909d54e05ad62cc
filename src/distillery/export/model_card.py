"""The export's own model card (``README.md`` of ``artifacts/export``): what it is, the chain that
made it, how it samples, how it scored, and the code that loads and samples it offline.

Everything comes from files the export stage already reads: the student's ``sampling.json``, the
lineage manifests of the student and its inputs (each artifact once, in the order the chain
reaches it), the validate stage's ``report/metrics.json`` (every metric) and ``report/report.json`` (the candidates of
this student and the reference teacher, and the prompt, seed, size and prompt length of the
snippet), and the base card's ``max_sequence_length`` (kept in the front matter: the folder stays
usable as a base, :func:`distillery.data.encoders.read_max_sequence_length`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from distillery.lineage.manifest import artifacts_once

# metrics of a validation candidate shown in the card: (metrics.json key, column title, format)
_COLUMNS = (("nfe", "NFE / video", "{:.0f}"), ("all", "adherence", "{:.2f}"), ("frechet_distance", "Fréchet to reference", "{:.2f}"),
            ("distance_to_teacher", "paired distance", "{:.4f}"), ("sharpness", "sharpness", "{:.5f}"),
            ("latency_s", "latency s / video (median, warm-up excluded)", "{:.3f}"))


def _own_params(node: dict[str, Any]) -> dict[str, Any]:
    params = node.get("params") or {}
    stage = node.get("stage")
    own = params.get(stage)
    return own if isinstance(own, dict) else {k: v for k, v in params.items() if k != "gpus"}


def _candidates(student: str, metrics: dict[str, float], reference: str | None) -> list[str]:
    names = list(dict.fromkeys(k.split("/")[0] for k in metrics))
    mine = [n for n in names if n.startswith(f"{student}_")]
    return ([reference] if reference and reference not in mine else []) + mine


def _metrics_table(names: list[str], metrics: dict[str, float]) -> list[str]:
    lines = ["| candidate | " + " | ".join(title for _, title, _ in _COLUMNS) + " |",
             "|---" * (len(_COLUMNS) + 1) + "|"]
    for name in names:
        cells = []
        for key, _, fmt in _COLUMNS:
            value, spread = metrics.get(f"{name}/{key}"), metrics.get(f"{name}/{key}_std")
            cell = "—" if value is None else fmt.format(value)
            if value is not None and spread is not None and key != "nfe":
                cell += " ± " + fmt.format(spread)
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def export_model_card(student: str, student_dir: Path, validate_dir: Path, max_sequence_length: int | None,
                      stock_nfe: int | None, folder: str = "artifacts/export") -> str:
    """The card's text. ``student``: the exported training stage; ``student_dir``: its artifact
    (``model/sampling.json``, ``lineage.json``); ``validate_dir``: the validate artifact; ``folder``:
    the export's path as the snippet names it (relative to the workspace root)."""
    contract = json.loads((student_dir / "model" / "sampling.json").read_text())
    manifest = json.loads((student_dir / "lineage.json").read_text())
    metrics = json.loads((validate_dir / "report" / "metrics.json").read_text())  # every metric (the stage's own: headline)
    report = json.loads((validate_dir / "report" / "report.json").read_text())
    cfg = report["config"]
    reference = report.get("reference")
    sampler = contract["sampler"]
    steps = contract.get("num_steps") or len(contract.get("timesteps") or []) or None
    front = ["---", "library_name: diffusers", "pipeline_tag: text-to-video", f"tags: [wan, distillery, {student}]",
             "distillery:"]
    if max_sequence_length is not None:
        front.append(f"  max_sequence_length: {max_sequence_length}")
    front += [f"  student: {student}", f"  sampler: {sampler}", "---", ""]
    lines = [f"# The `{student}` student, exported by distillery", "",
             f"A Wan 2.1 text-to-video model in diffusers layout: the transformer trained by the `{student}` stage "
             f"(`{manifest.get('method')}`), with the base's VAE, text encoder and tokenizer. It samples with the "
             f"`{sampler}` sampler of `sampling.json`"
             + (f" at {steps} steps" if steps else "") + f" (guidance {contract.get('guidance_scale', 1.0)}).", ""]
    lines += ["## Sampling settings (`sampling.json`)", "", "```json", json.dumps(contract, indent=2), "```", ""]
    lines += ["## How it was made (from `lineage.json`; `distillery lineage <this folder>` prints the whole tree)", "",
              "| stage | kind | method | its params | artifact digest |", "|---|---|---|---|---|"]
    for node in artifacts_once(manifest):
        method = (node.get("method") or "—").rsplit(".", 1)[-1]
        params = json.dumps(_own_params(node), sort_keys=True).replace("|", "/")
        lines.append(f"| {node.get('stage')} | {node.get('kind')} | {method} | `{params}` | "
                     f"`{str(node.get('manifest_sha256', ''))[:16]}` |")
    lines += ["", f"## Validation (the validate stage: {len(report.get('prompts', []))} prompts × "
              f"{report.get('num_seeds', 1)} seeds, ± over seeds; reference `{reference}`)", ""]
    lines += _metrics_table(_candidates(student, metrics, reference), metrics)
    prompt, seed = report["prompts"][0], report["seeds"][0]
    size = f"num_frames={cfg['num_frames']}, height={cfg['height']}, width={cfg['width']}"
    lines += ["", "## Load and sample it (offline)", "",
              f"Run from the workspace root (or replace `{folder}` by where this folder is); it needs the `distillery` "
              "package. For this prompt and seed it returns the video validate scored.", "", "```python",
              "import torch", "from diffusers import DiffusionPipeline", "",
              f'folder = "{folder}"',
              "pipe = DiffusionPipeline.from_pretrained(folder, custom_pipeline=folder, trust_remote_code=True)",
              f"video = pipe({json.dumps(prompt)}, {size}, max_sequence_length={report['max_sequence_length']},",
              f"            generator=torch.Generator().manual_seed({seed})).frames[0]",
              "print(video.shape)", "```", ""]
    if stock_nfe is not None:
        lines += [f"`transformer/` alone is the student at {stock_nfe} NFE fused into a plain transformer: stock "
                  "`WanPipeline` samples it with its shift's Euler scheduler (no distillery needed):", "", "```python",
                  "import torch", "from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline", "",
                  f'pipe = WanPipeline.from_pretrained("{folder}")',
                  f"pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift={contract.get('shift')})",
                  f"video = pipe({json.dumps(prompt)}, {size}, max_sequence_length={report['max_sequence_length']},",
                  f"            num_inference_steps={stock_nfe}, guidance_scale=1.0, generator=torch.Generator().manual_seed({seed})).frames[0]",
                  "print(video.shape)", "```", ""]
    return "\n".join(front + lines)
