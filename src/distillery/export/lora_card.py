"""The export's folder and model card when it ships a LoRA adapter (``params.yaml export.lora: adapter``).

The folder holds the adapter alone: ``pytorch_lora_weights.safetensors`` (diffusers' LoRA layout, what a stock
pipeline's ``load_lora_weights`` reads), ``base.json`` (its rank, alpha, targets and the base it was trained on: the
transformer folder and its sha256), the student's ``sampling.json`` and ``README.md`` (this card: which base it needs,
how to load it). The weights an adapter needs are not in it: it applies to its base's transformer only. A student of
two experts (Wan 2.2 A14B) ships both experts' adapters: the low-noise expert's is
``pytorch_lora_weights_2.safetensors``, loaded onto ``transformer_2`` (``load_into_transformer_2=True``), its base
``base.json``'s ``base.second``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from distillery.common.errors import UserError
from distillery.models.lora import BASE_FILE, LORA_WEIGHTS_FILE, LORA_WEIGHTS_FILE_2


def adapter_folder(student: str, student_model: Path) -> Path:
    """``<student artifact>/model/lora`` when the student stage trained a LoRA; else a :class:`UserError` line."""
    folder = student_model / "lora"
    if not (folder / LORA_WEIGHTS_FILE).is_file() or not (folder / BASE_FILE).is_file():
        raise UserError(f"params.yaml: export.lora: adapter: the {student} stage trained its full weights, not a LoRA "
                        f"({student}.lora_rank: 0; {folder} holds none); set {student}.lora_rank above 0 and rerun it, "
                        "or export merged weights (export.lora: merged)")
    return folder


def assemble_adapter_export(student_model: Path, out: Path) -> dict[str, Any]:
    """Copy the adapter, its ``base.json`` and the student's ``sampling.json`` into ``out``; returns ``base.json``."""
    from distillery.common.fsutil import follow_umask

    lora = student_model / "lora"
    for name in (LORA_WEIGHTS_FILE, BASE_FILE, LORA_WEIGHTS_FILE_2):
        if name != LORA_WEIGHTS_FILE_2 or (lora / name).is_file():  # the second: a student of two experts
            shutil.copy2(lora / name, out / name)
    shutil.copy2(student_model / "sampling.json", out / "sampling.json")
    follow_umask(out)
    return json.loads((out / BASE_FILE).read_text())


def adapter_model_card(student: str, info: dict[str, Any], contract: dict[str, Any], folder: str = "artifacts/export",
                       model_folder: str = "artifacts/base/model") -> str:
    """The card of an adapter export: ``info`` is its ``base.json``; ``contract`` the student's ``sampling.json``;
    ``folder``: the export as the snippet names it; ``model_folder``: the diffusers folder whose VAE, text encoder and
    scheduler the snippet loads around the base transformer."""
    base = info.get("base") or {}
    base_path = str(base.get("path"))
    second = base.get("second") if isinstance(base.get("second"), dict) else None  # two experts: transformer_2's base
    from distillery.export.code import stock_samples

    stock = stock_samples(contract)  # plain bidirectional Euler: stock WanPipeline samples it as validated
    targets = ", ".join(info.get("target_modules") or [])
    lines = ["---", "library_name: diffusers", "pipeline_tag: text-to-video", f"tags: [wan, distillery, lora, {student}]",
             "distillery:", f"  student: {student}", "  form: lora-adapter", f"  base_transformer: {base_path}",
             f"  base_sha256: {base.get('sha256')}", "---", "",
             f"# The `{student}` student as a LoRA adapter, exported by distillery", "",
             f"A LoRA adapter (rank {info.get('rank')}, alpha {info.get('alpha')}, on {targets}) of a "
             + ("Wan 2.2 A14B text-to-video model's two experts (both adapted)" if second else "Wan 2.1 text-to-video transformer")
             + f", trained by the `{student}` stage. **It needs its base:** the transformer "
             f"`{base_path}` (sha256 over its files `{base.get('sha256')}`, as `distillery` hashes a folder: relative "
             "name and content digest of each file, in name order)"
             + (f" and the low-noise expert `{second.get('path')}` (sha256 `{second.get('sha256')}`)" if second else "")
             + "; on another base it is not this model. The "
             f"VAE, text encoder and tokenizer are the base model's (`{model_folder}`).", "",
             f"`{LORA_WEIGHTS_FILE}` is in diffusers' LoRA layout: stock `load_lora_weights` loads it onto the base "
             + (f"(PEFT installed); `{LORA_WEIGHTS_FILE_2}` is the low-noise expert's, loaded onto `transformer_2`. "
                if second else "(PEFT installed). ")
             + "The merged form of the same model (`export.lora: merged`) ships the full weights and "
             "the pipeline that samples it as trained (`sampling.json`).", "",
             "## Load it onto its base (stock diffusers)", "", "```python", "import torch",
             "from diffusers import WanPipeline, WanTransformer3DModel", "",
             f'transformer = WanTransformer3DModel.from_pretrained("{base_path}", dtype=torch.bfloat16)']
    if second:
        lines += [f'transformer_2 = WanTransformer3DModel.from_pretrained("{second.get("path")}", dtype=torch.bfloat16)',
                  f'pipe = WanPipeline.from_pretrained("{model_folder}", transformer=transformer, transformer_2=transformer_2, '
                  "dtype=torch.bfloat16)",
                  f'pipe.load_lora_weights("{folder}")  # {LORA_WEIGHTS_FILE}: transformer',
                  f'pipe.load_lora_weights("{folder}", weight_name="{LORA_WEIGHTS_FILE_2}", load_into_transformer_2=True)',
                  "```", ""]
    else:
        lines += [f'pipe = WanPipeline.from_pretrained("{model_folder}", transformer=transformer, dtype=torch.bfloat16)',
                  f'pipe.load_lora_weights("{folder}")  # {LORA_WEIGHTS_FILE}', "```", ""]
    if not stock:
        lines += [f"The student samples with the `{contract.get('sampler')}` sampler of `sampling.json`, which stock "
                  "`WanPipeline`'s many-step loop is not: the snippet gives the adapted transformer; to sample it as "
                  "validated, export it merged (`export.lora: merged`), whose folder ships that sampler.", ""]
    lines += ["## Sampling settings (`sampling.json`)", "", "```json", json.dumps(contract, indent=2), "```", ""]
    return "\n".join(lines)
