"""The export of an image-to-video model (a Wan 2.1 I2V base, issue 45): what stock ``WanImageToVideoPipeline`` samples,
and its model card.

A model of an I2V base is exported as a diffusers folder: the base's parts (with the image encoder and processor) and
the student's transformer. Where its sampling contract is plain Euler with CFG (:func:`distillery.export.code.stock_samples`:
the teacher's) its ``model_index.json`` names stock ``WanImageToVideoPipeline``; every other student (a few-step ladder,
block-causal Euler, causal streaming, PDD) is sampled by the folder's own pipeline
(:class:`distillery.export.standalone.pipeline.DistilledWanPipeline`), which takes the first frame (``image=``, or the
condition latents and image embeddings precomputed) and loads the folder's image encoder and processor. A two-expert
(Wan 2.2 I2V-A14B) student that stock code does not sample is one line before any work
(:func:`distillery.export.code.check_own_pipeline_samples`: the own pipeline routes two text-to-video experts; its
first frame through two experts is not tested).
"""

from __future__ import annotations

import json
from pathlib import Path

from distillery.export.code import stock_samples
from distillery.export.model_card import install_words, save_lines
from distillery.lineage.render import artifacts_once

I2V_PIPELINE = "WanImageToVideoPipeline"


def is_i2v_folder(folder: Path) -> bool:
    """Whether ``folder``'s ``model_index.json`` names :data:`I2V_PIPELINE`."""
    index = Path(folder) / "model_index.json"
    try:
        return json.loads(index.read_text()).get("_class_name") == I2V_PIPELINE
    except (OSError, ValueError, AttributeError):
        return False


def i2v_model_card(student: str, student_dir: Path, validate_dir: Path, max_sequence_length: int | None,
                   folder: str = "artifacts/export") -> str:
    """The card of an I2V export: what it is, its chain, its validation, and the stock ``WanImageToVideoPipeline``
    call at the validated steps and guidance (the first frame given as an image; the prompt as embeddings or text)."""
    contract = json.loads((student_dir / "model" / "sampling.json").read_text())
    manifest = json.loads((student_dir / "lineage.json").read_text())
    report = json.loads((validate_dir / "report" / "report.json").read_text())
    candidates = [c for c in report.get("candidates", []) if str(c.get("name", "")).startswith(f"{student}_")]
    steps = int(candidates[0]["num_steps"]) if candidates else int(contract.get("num_steps") or 50)
    guidance = float(candidates[0]["guidance_scale"]) if candidates else float(contract.get("guidance_scale", 5.0) or 5.0)
    cfg = report.get("config", {})
    size = f"num_frames={cfg.get('num_frames')}, height={cfg.get('height')}, width={cfg.get('width')}"
    stock = stock_samples(contract)
    front = ["---", "library_name: diffusers", "pipeline_tag: image-to-video", f"tags: [wan, distillery, image-to-video, {student}]",
             "distillery:", *([f"  max_sequence_length: {max_sequence_length}"] if max_sequence_length else []),
             f"  student: {student}", f"  sampler: {contract.get('sampler')}", "---", ""]
    lines = [f"# The `{student}` image-to-video model, exported by distillery", "",
             f"A Wan 2.1 image-to-video model in diffusers layout: the transformer the `{student}` stage trained "
             f"(`{manifest.get('method')}`) on the latents with their first frames as the condition, with the base's VAE, "
             "text encoder, tokenizer, image encoder and image processor. "
             + (f"It is a stock Wan I2V model: stock `{I2V_PIPELINE}` samples it (below). " if stock else
                f"It samples by its `{contract.get('sampler')}` contract (`sampling.json`), which stock `{I2V_PIPELINE}` "
                "does not run: the folder's own pipeline (`pipeline.py`, `DistilledWanPipeline`, and the modules beside "
                "it) does, and takes the first frame as `image=` (below). ")
             + f"Validate scored it with the first frames of the latent set's validation clips at {steps} steps, "
             f"guidance {guidance}.", "",
             "## Sampling settings (`sampling.json`)", "", "```json", json.dumps(contract, indent=2), "```", "",
             "## How it was made (from `lineage.json`)", "", "| stage | kind | artifact digest |", "|---|---|---|"]
    for node in artifacts_once(manifest):
        lines.append(f"| {node.get('stage')} | {node.get('kind')} | `{str(node.get('manifest_sha256', ''))[:16]}` |")
    prompt, seed = (report.get("prompts") or [""])[0], (report.get("seeds") or [0])[0]
    lines += ["", "## Load and sample it (offline: torch, diffusers, transformers, accelerate; `ftfy` for text prompts)", "",
              install_words(), ""]
    fps = float((report.get("config") or {}).get("fps", 16))
    call = [f"video = pipe(image=image, prompt={json.dumps(prompt)}, {size},",
            f"            max_sequence_length={max_sequence_length or 512}, num_inference_steps={steps}, guidance_scale={guidance},",
            f"            generator=torch.Generator().manual_seed({seed})).frames[0]"]
    if stock:
        lines += ["```python", "import torch", "from PIL import Image",
                  f"from diffusers import FlowMatchEulerDiscreteScheduler, {I2V_PIPELINE}", "from diffusers.utils import export_to_video", "",
                  f'pipe = {I2V_PIPELINE}.from_pretrained("{folder}")',
                  f"pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift={contract.get('shift')})",
                  'image = Image.open("first_frame.png")  # the frame the video starts from', *call,
                  *save_lines(fps), "```", ""]
    else:
        lines += ["The folder's own pipeline builds the first frame's condition as the stock pipeline does (the VAE's "
                  "latent of the frame then zeros, after the first latent frame's mask; the image encoder's penultimate "
                  "hidden states); `first_frame=` and `image_embeds=` take them precomputed instead of `image=`.", "",
                  "```python", "import torch", "from PIL import Image", "from diffusers import DiffusionPipeline",
                  "from diffusers.utils import export_to_video", "",
                  f'pipe = DiffusionPipeline.from_pretrained("{folder}", custom_pipeline="{folder}", trust_remote_code=True)',
                  'image = Image.open("first_frame.png")  # the frame the video starts from', *call,
                  *save_lines(fps), "```", ""]
    return "\n".join(front + lines)
