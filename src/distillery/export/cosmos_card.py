"""The load-and-sample sections of a Cosmos Predict 2.5 export's model card (the rest of the card is
:func:`distillery.export.model_card.export_model_card`'s, as for Wan).

Two things differ from a Wan export's snippets, both from diffusers' ``Cosmos2_5_PredictBasePipeline``:

- **a safety checker**: the stock pipeline (and the folder's own, ``pipeline_cosmos.py``) does not run without one —
  NVIDIA's guardrail (``cosmos_guardrail.CosmosSafetyChecker``, which fetches its own models) or the caller's object
  with ``to(device)`` and ``check_text_safety(prompt)``; the snippets take it as ``checker``;
- **its guidance form**: the stock pipeline guides ``c + g (c − u)``, distillery ``u + w (c − u)``: the stock
  ``guidance_scale`` is ``w − 1``, and the stock pipeline guides only above 1 — so a teacher validated at ``w`` in
  (1, 2] has no stock call that reproduces it (the card says so), one at ``w`` ≤ 1 is the stock call at 1.0.
"""

from __future__ import annotations

import json
from typing import Any

from distillery.export.code import stock_samples

CHECKER = ("checker = ...  # cosmos_guardrail.CosmosSafetyChecker() (NVIDIA's guardrail), or your own object with "
           "to(device) and check_text_safety(prompt)")


def stock_guidance(guidance: float) -> float | None:
    """The stock pipeline's ``guidance_scale`` for distillery's ``w`` (module doc); None where none reproduces it."""
    if guidance <= 1.0:
        return 1.0
    return guidance - 1.0 if guidance > 2.0 else None


def own_pipeline_lines(folder: str, contract: dict[str, Any], prompt: str, size: str, max_sequence_length: int,
                       call_args: str, marker: str, seed: int) -> list[str]:
    """The snippet through the folder's own pipeline (``pipeline_cosmos.py``; guidance as distillery's) — for a
    teacher, whose index names the stock pipeline, one sentence pointing at :func:`stock_lines`."""
    if stock_samples(contract):  # the teacher: its model_index.json names the stock pipeline (stock_lines)
        return ["Stock `Cosmos2_5_PredictBasePipeline` samples it (below)."]
    own = (" Its `model_index.json` names this pipeline (`_class_name`: `pipeline_cosmos.DistilledCosmosPipeline`): stock "
           "`Cosmos2_5_PredictBasePipeline` would sample it with the teacher's many-step loop, so diffusers loads it only "
           "with `trust_remote_code=True`, and then as this pipeline.")
    return ["The folder's own modules (`pipeline_cosmos.py`, `pipeline.py` and the `distilled_*.py` they import) do the "
            "sampling, with distillery's guidance `u + w (c − u)`; nothing of distillery is imported. For this prompt "
            "and seed, at these steps and guidance, it returns the video validate scored." + own, "",
            "`trust_remote_code=True` runs this folder's code: verify the folder first, where distillery is installed — "
            f"`distillery lineage {folder} --verify --expect <the manifest digest published with the model>`.", "",
            "```python", "import torch", "from diffusers import DiffusionPipeline", "", CHECKER, f'folder = "{folder}"',
            "pipe = DiffusionPipeline.from_pretrained(folder, trust_remote_code=True, safety_checker=checker)",
            f"video = pipe({json.dumps(prompt)}, negative_prompt=\"\", {size}, max_sequence_length={max_sequence_length},",
            f"            {call_args}{marker}",
            f"            generator=torch.Generator().manual_seed({seed})).frames[0]",
            "print(video.shape)", "```", ""]


def stock_lines(folder: str, contract: dict[str, Any], prompt: str, size: str, max_sequence_length: int, steps: int,
                guidance: float, name: str | None, seed: int) -> list[str]:
    """The stock ``Cosmos2_5_PredictBasePipeline`` snippet of a teacher (the folder's Euler scheduler of its shift)."""
    scale = stock_guidance(guidance)
    if scale is None:
        return [f"Validate guided it at {guidance} (`u + w (c − u)`); stock `Cosmos2_5_PredictBasePipeline` guides "
                "`c + g (c − u)` and only for g > 1, so no stock call reproduces w in (1, 2] (validate the teacher at "
                "w ≤ 1 or w > 2 for one).", ""]
    marker = f"  # validate's {name}" if name else ""
    return ["It is a stock Cosmos Predict 2.5 model: stock `Cosmos2_5_PredictBasePipeline` samples it with no code of "
            f"the folder and the Euler scheduler of its shift, returning validate's video (within float rounding). Its "
            f"`guidance_scale` is distillery's minus one (the stock pipeline guides `c + g (c − u)`): {scale} here.", "",
            "```python", "import torch", "from diffusers import Cosmos2_5_PredictBasePipeline, FlowMatchEulerDiscreteScheduler",
            "", CHECKER, f'pipe = Cosmos2_5_PredictBasePipeline.from_pretrained("{folder}", safety_checker=checker)',
            f"pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift={contract.get('shift')})",
            f"video = pipe(prompt={json.dumps(prompt)}, negative_prompt=\"\", {size}, "
            f"max_sequence_length={max_sequence_length},",
            f"            num_inference_steps={steps}, guidance_scale={scale},{marker}",
            f"            generator=torch.Generator().manual_seed({seed})).frames[0]",
            "print(video.shape)", "```", ""]
