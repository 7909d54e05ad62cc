"""The load-and-sample sections of a HunyuanVideo 1.5 export's model card (the rest of the card is
:func:`distillery.export.model_card.export_model_card`'s, as for Wan).

What differs from a Wan export's snippets, from diffusers' ``HunyuanVideo15Pipeline``: its guidance is its guider's
(``ClassifierFreeGuidance``, ``u + w (c − u)`` as distillery's, set by ``pipe.guider = pipe.guider.new(guidance_scale=w)``,
not a call argument), its σ grid is its own (``linspace``: the contract's ``sigma_grid``), and the prompt is two
streams (Qwen2.5-VL's and ByT5's) it encodes itself — no ``max_sequence_length``.
"""

from __future__ import annotations

import json
from typing import Any

from distillery.export.code import stock_samples

STOCK_PIPELINE = "HunyuanVideo15Pipeline"


def own_pipeline_lines(folder: str, contract: dict[str, Any], prompt: str, size: str, call_args: str, marker: str,
                       seed: int) -> list[str]:
    """The snippet through the folder's own pipeline (``pipeline_hunyuan15.py``) — for a teacher, whose index names the
    stock pipeline, one sentence pointing at :func:`stock_lines`."""
    if stock_samples(contract):
        return [f"Stock `{STOCK_PIPELINE}` samples it (below)."]
    own = (" Its `model_index.json` names this pipeline (`_class_name`: `pipeline_hunyuan15.DistilledHunyuanVideo15Pipeline`): "
           f"stock `{STOCK_PIPELINE}` would sample it with the teacher's many-step loop, so diffusers loads it only with "
           "`trust_remote_code=True`, and then as this pipeline.")
    return ["The folder's own modules (`pipeline_hunyuan15.py`, `pipeline.py` and the `distilled_*.py` they import) do the "
            "sampling; nothing of distillery is imported. For this prompt and seed, at these steps and guidance, it "
            "returns the video validate scored." + own, "",
            "`trust_remote_code=True` runs this folder's code: verify the folder first, where distillery is installed — "
            f"`distillery lineage {folder} --verify --expect <the manifest digest published with the model>`.", "",
            "```python", "import torch", "from diffusers import DiffusionPipeline", "", f'folder = "{folder}"',
            "pipe = DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)",
            f"video = pipe({json.dumps(prompt)}, negative_prompt=\"\", {size},",
            f"            {call_args}{marker}",
            f"            generator=torch.Generator().manual_seed({seed})).frames[0]",
            "print(video.shape)", "```", ""]


def stock_lines(folder: str, contract: dict[str, Any], prompt: str, size: str, steps: int, guidance: float,
                name: str | None, seed: int, fused_nfe: int | None = None) -> list[str]:
    """The stock ``HunyuanVideo15Pipeline`` snippet of a teacher (at ``steps`` and ``guidance``) or, ``fused_nfe`` set,
    of a PDD student fused into a plain transformer (at that NFE, no CFG), with the Euler scheduler of its shift."""
    if fused_nfe is not None:
        intro = (f"`transformer/` alone is the student at {fused_nfe} NFE fused into a plain transformer: stock "
                 f"`{STOCK_PIPELINE}` samples it with its shift's Euler scheduler (the folder's parts, loaded through its "
                 "own pipeline; stock code samples):")
        load = [f'folder = "{folder}"',
                f"pipe = {STOCK_PIPELINE}(**DiffusionPipeline.from_pretrained(folder, trust_remote_code=True).components)"]
        steps, guidance = fused_nfe, 1.0
    else:
        intro = (f"It is a stock HunyuanVideo 1.5 model: stock `{STOCK_PIPELINE}` samples it with no code of the folder and "
                 "the Euler scheduler of its shift, returning validate's video (within float rounding); its guidance is "
                 "the guider's, set as below.")
        load = [f'pipe = {STOCK_PIPELINE}.from_pretrained("{folder}")']
    marker = f"  # validate's {name}" if name else ""
    return [intro, "", "```python", "import torch",
            f"from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, {STOCK_PIPELINE}", "", *load,
            f"pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift={contract.get('shift')})",
            f"pipe.guider = pipe.guider.new(guidance_scale={guidance})",
            f"video = pipe(prompt={json.dumps(prompt)}, negative_prompt=\"\", {size},",
            f"            num_inference_steps={steps},{marker}",
            f"            generator=torch.Generator().manual_seed({seed})).frames[0]",
            "print(video.shape)", "```", ""]
