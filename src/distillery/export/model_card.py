"""The export's own model card (``README.md`` of ``artifacts/export``): what it is, the chain that
made it, how it samples, how it scored, and the code that loads and samples it offline.

Everything comes from files the export stage already reads: the student's ``sampling.json``, the
lineage manifests of the student and its inputs (each artifact once, in the order the chain
reaches it), the validate stage's ``report/metrics.json`` (every metric) and ``report/report.json`` (the candidates of
this student and the reference teacher, and the prompt, seed, size and prompt length of the
snippet), and the base card's ``max_sequence_length`` (kept in the front matter: the teacher's export stays
usable as a base, :func:`distillery.data.encoders.read_max_sequence_length`; a student's ``model_index.json``
names its own pipeline, :mod:`distillery.export.code`, which the base stage refuses as code from the folder).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from distillery.export.code import REQUIREMENTS, sparse_record, stock_samples
from distillery.lineage.render import artifacts_once

# metrics of a validation candidate shown in the card: (metrics.json key, column title, format); latency only where
# validate recorded the machine and its load (:func:`_latency_context`)
_COLUMNS = (("nfe", "NFE / video", "{:.0f}"), ("all", "adherence", "{:.2f}"), ("frechet_distance", "Fréchet to reference", "{:.2f}"),
            ("distance_to_teacher", "paired distance", "{:.4f}"), ("sharpness", "sharpness", "{:.5f}"))
_LATENCY = ("latency_s", "latency s / video (median, warm-up excluded)", "{:.3f}")


def _own_params(node: dict[str, Any]) -> dict[str, Any]:
    params = node.get("params") or {}
    stage = node.get("stage")
    own = params.get(stage)
    return own if isinstance(own, dict) else {k: v for k, v in params.items() if k != "gpus"}


def _candidates(student: str, metrics: dict[str, float], reference: str | None) -> list[str]:
    names = list(dict.fromkeys(k.split("/")[0] for k in metrics))
    mine = [n for n in names if n.startswith(f"{student}_")]
    return ([reference] if reference and reference not in mine else []) + mine


def _metrics_table(names: list[str], metrics: dict[str, float], columns: tuple) -> list[str]:
    lines = ["| candidate | " + " | ".join(title for _, title, _ in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name in names:
        cells = []
        for key, _, fmt in columns:
            value, spread = metrics.get(f"{name}/{key}"), metrics.get(f"{name}/{key}_std")
            cell = "—" if value is None else fmt.format(value)
            if value is not None and spread is not None and key != "nfe":
                cell += " ± " + fmt.format(spread)
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _vbench_lines(names: list[str], metrics: dict[str, float]) -> list[str]:
    """The VBench dimensions validate scored ``names`` on (``validate.vbench``: ``<candidate>/vbench_<dimension>``,
    ×100) as a section of the card, with the protocol they were computed under; none without them."""
    dims = list(dict.fromkeys(k.split("/", 1)[1] for k in metrics if k.split("/", 1)[0] in names and "/vbench_" in k))
    shown = [n for n in names if any(f"{n}/{d}" in metrics for d in dims)]
    if not shown:
        return []
    columns = tuple((d, d.removeprefix("vbench_").replace("_", " "), "{:.2f}") for d in dims)
    return ["", "## VBench dimensions (validate.vbench, ×100)", "", *_metrics_table(shown, metrics, columns), "",
            "Computed as vbench 0.1.5 computes them (docs/vbench.md) on validate's own prompts and seeds: protocol "
            "`custom`, not comparable with published rows, which use VBench's prompt suite. The validate artifact's "
            "`report/vbench/vbench.md` sets them beside the published rows, its `vbench.json` names each model and digest."]


def _latency_context(report: dict[str, Any]) -> str | None:
    """The machine and load validate measured its latencies under, as one phrase — or None when its report
    does not say (then the card prints no latency: a number without its machine and load reads as the model's)."""
    latency = report.get("latency") if isinstance(report.get("latency"), dict) else {}
    machine = latency.get("machine") or report.get("machine")
    load = latency.get("load") or report.get("load")
    if not machine or load is None:
        return None
    describe = lambda v: ", ".join(f"{k} {w}" for k, w in v.items()) if isinstance(v, dict) else str(v)  # noqa: E731
    return f"on {describe(machine)}, load {describe(load)}"


def validated_candidate(student: str, contract: dict[str, Any], report: dict[str, Any]) -> dict[str, Any] | None:
    """The validate candidate (its ``report.json`` entry: name, num_steps, guidance_scale, ...) whose samples the
    card's snippets reproduce: for the teacher the reference (or its first candidate), for a student the one at
    its contract's default step count (else its first); None when validate scored none of ``student``'s."""
    mine = [c for c in report.get("candidates", []) if str(c.get("name", "")).startswith(f"{student}_")]
    if not mine:
        return None
    if student == "teacher":
        return next((c for c in mine if c["name"] == report.get("reference")), mine[0])
    steps = contract.get("num_steps") or len(contract.get("timesteps") or []) or None
    return next((c for c in mine if steps is not None and int(c.get("num_steps", -1)) == int(steps)), mine[0])


def _nfe_lines(contract: dict[str, Any], metrics: dict[str, float], candidate: dict[str, Any] | None) -> list[str]:
    """What "NFE" counts for a streaming student, with the numbers of the validated video (its ``nfe`` metric:
    branches × (chunks × steps + chunks − 1))."""
    if contract.get("sampler") != "causal_streaming" or candidate is None or f"{candidate['name']}/nfe" not in metrics:
        return []
    chunk, steps = int(contract["chunk_size"]), int(candidate["num_steps"])
    branches = 2 if float(candidate.get("guidance_scale", 1.0)) > 1 else 1
    per_video = int(metrics[f"{candidate['name']}/nfe"])
    chunks = (per_video // branches + 1) // (steps + 1)
    if contract.get("given_first_frame"):  # + 1 forward writing the given frame 0 into the cache: chunks × (steps + 1)
        chunks = per_video // branches // (steps + 1)
        return ["", f"**NFE (transformer forwards) of this streaming image-to-video student.** Latent frame 0 is the "
                f"given frame: one forward writes its clean latent into the KV cache (it is never denoised). Then it "
                f"generates chunk by chunk: at validate's size, {chunks} chunk(s) of {chunk} latent frame(s), each "
                f"{steps} denoising forwards, then one more writing it into the cache (none after the last): **1 + "
                f"{chunks} × {steps} + {chunks - 1} = {per_video // branches} per video**"
                + (f" (× 2: CFG, {per_video})" if branches == 2 else "") + "."]
    return ["", f"**NFE (transformer forwards) of this streaming student.** It generates the video chunk by chunk: at "
            f"validate's size, {chunks} chunk(s) of {chunk} latent frame(s). Each chunk takes {steps} denoising "
            f"forwards (its {steps}-step ladder), then one more forward writes the finished chunk into the KV cache "
            f"for the chunks after it (none after the last): **{steps + 1} forwards per chunk, {chunks} × {steps} + "
            f"{chunks - 1} = {per_video} per video**" + (" (× 2: CFG)" if branches == 2 else "")
            + f". A {steps}-step bidirectional student takes {steps * branches} forwards of the whole video, each on "
            f"{chunks}× the tokens a streaming forward sees: compare candidates by latency beside NFE."]


CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"  # PyPI's default torch brings CUDA's libraries
VIDEO_WRITER = ("imageio", "imageio-ffmpeg")  # what diffusers' export_to_video writes an mp4 with


def install_words() -> str:
    """How to install what loading, sampling and saving the video need — on a GPU machine and on a CPU one."""
    return (f"Install them (`pip install {' '.join(REQUIREMENTS)}`; on a machine without a CUDA GPU run `{CPU_TORCH}` "
            "first: PyPI's default torch brings the CUDA libraries, gigabytes a CPU never uses; this folder was made with "
            f"{_versions()}), and `pip install {' '.join(VIDEO_WRITER)}` to save the video as an mp4 (diffusers' "
            "`export_to_video` writes with them). Diffusers loads Wan's transformer only where accelerate is installed.")


def save_lines(fps: float) -> list[str]:
    """The snippet's last lines: the frames (float RGB in [0, 1], ``[T, H, W, 3]``) written as an mp4."""
    return ["print(video.shape)  # (frames, height, width, 3), RGB in [0, 1]",
            f'export_to_video(video, "video.mp4", fps={fps:g})  # needs imageio and imageio-ffmpeg']


def latents_note(candidate: dict[str, Any] | None, prompt_index: int = 0) -> list[str]:
    """Which key of validate's ``latents.safetensors`` the snippet's call reproduces, and how the keys are named."""
    if candidate is None:
        return []
    return [f"With `output_type=\"latent\"` the call returns validate's stored latents of this video: "
            f"`artifacts/validate/samples/{candidate['name']}/latents.safetensors`, key `\"{prompt_index}\"`. Its keys: "
            "`\"<i>\"` is prompt #i of validate's `report.json` `prompts` at seed `seeds[i]` (seed index 0), `\"<i>_s<j>\"` "
            "the same prompt at seed index j (`seed_grid[i][j]`); each holds float32 `[C, T, H, W]`.", ""]


def _listed(names: tuple[str, ...]) -> str:
    """``a, b, c and d``."""
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]


def _versions() -> str:
    """The installed versions of :data:`~distillery.export.code.REQUIREMENTS` (the export's making), as a phrase."""
    from importlib.metadata import PackageNotFoundError, version

    def one(name: str) -> str:
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            return f"{name} (not installed)"

    return ", ".join(one(name) for name in REQUIREMENTS)


COSMOS_FAMILY = "cosmos-predict2.5"  # the registry's name of the family whose card sections are export/cosmos_card.py's
HUNYUAN15_FAMILY = "hunyuanvideo1.5"  # the family whose card sections are export/hunyuan15_card.py's
#: a family's tag and stock pipeline as the card names them (the Wan families: ``wan``, ``WanPipeline``)
FAMILY_STOCK = {COSMOS_FAMILY: ("cosmos", "Cosmos", "Cosmos2_5_PredictBasePipeline"),
                HUNYUAN15_FAMILY: ("hunyuanvideo1.5", "HunyuanVideo 1.5", "HunyuanVideo15Pipeline")}
FAMILY_WORDS = {  # a model family (models/registry.py) as the card names it, with its layout
    "wan2.1": "Wan 2.1",
    "wan2.2-ti2v-5b": "Wan 2.2 TI2V-5B (one timestep per token, the 48-channel Wan 2.2 VAE)",
    "wan2.2-a14b": "Wan 2.2 A14B (two experts: `transformer` denoises timesteps >= `boundary_ratio` · 1000 of "
                   "`model_index.json`, `transformer_2` those below; both trained, both in this folder)",
    "cosmos-predict2.5": "Cosmos Predict 2.5 (text-to-world; its VAE is Wan 2.1's, its prompts Qwen2.5-VL's)",
    "hunyuanvideo1.5": "HunyuanVideo 1.5 (its prompts two streams: Qwen2.5-VL's and ByT5's; its own VAE and σ grid)",
}


def model_words(model: Path) -> str:
    """The card's name of the model in ``model`` (an artifact's ``model/``): its family and layout (:data:`FAMILY_WORDS`;
    the family's registry name for one not listed)."""
    from distillery.models.registry import family_of

    name = family_of(model).name
    return FAMILY_WORDS.get(name, name)


def export_model_card(student: str, student_dir: Path, validate_dir: Path, max_sequence_length: int | None,
                      stock_nfe: int | None, folder: str = "artifacts/export") -> str:
    """The card's text. ``student``: the exported training stage; ``student_dir``: its artifact
    (``model/sampling.json``, ``lineage.json``); ``validate_dir``: the validate artifact; ``folder``:
    the export's path as the snippets name it (relative to the workspace root).

    Its snippets pass the steps and guidance of the validate candidate they reproduce
    (:func:`validated_candidate`, named in a ``# validate's <candidate>`` comment): the custom pipeline's,
    and stock ``WanPipeline``'s where a plain transformer is the model (the teacher; a fused PDD student at
    ``stock_nfe``)."""
    contract = json.loads((student_dir / "model" / "sampling.json").read_text())
    sparse = sparse_record(student_dir / "model" / "transformer")  # trained sparse: only its own pipeline samples it
    manifest = json.loads((student_dir / "lineage.json").read_text())
    metrics = json.loads((validate_dir / "report" / "metrics.json").read_text())  # every metric (the stage's own: headline)
    report = json.loads((validate_dir / "report" / "report.json").read_text())
    cfg = report["config"]
    reference = report.get("reference")
    sampler = contract["sampler"]
    teacher = student == "teacher"
    candidate = validated_candidate(student, contract, report)
    steps = contract.get("num_steps") or len(contract.get("timesteps") or []) or None
    guidance = float(contract.get("guidance_scale", 1.0) or 1.0)
    guidance_2 = contract.get("guidance_scale_2")  # two experts: the low-noise expert's scale, as WanPipeline takes it
    if candidate is not None:
        steps, guidance = int(candidate["num_steps"]), float(candidate["guidance_scale"])
        guidance_2 = (candidate.get("options") or {}).get("guidance_scale_2", guidance_2)
    second = "" if guidance_2 is None else f" guidance_scale_2={float(guidance_2)},"
    method = manifest.get("method")
    from distillery.models.registry import family_of

    family = family_of(student_dir / "model").name
    cosmos = family == COSMOS_FAMILY  # its snippets: export/cosmos_card.py
    tag, kind, stock_class = FAMILY_STOCK.get(family, ("wan", "Wan", "WanPipeline"))
    front = ["---", "library_name: diffusers", "pipeline_tag: text-to-video",
             f"tags: [{tag}, distillery, {student}]", "distillery:"]
    if max_sequence_length is not None:
        front.append(f"  max_sequence_length: {max_sequence_length}")
    front += [f"  student: {student}", f"  sampler: {sampler}", "---", ""]
    if teacher:
        lines = ["# The teacher, exported by distillery", "",
                 f"A {model_words(student_dir / 'model')} text-to-video model in diffusers layout: the transformer the `teacher` stage fine-tuned "
                 f"(`{method}`) on the latents, with the base's VAE, text encoder and tokenizer. It is a stock "
                 + f"{kind} model: stock `{stock_class}`"
                 + f" samples it (below). Validate scored it with the `{sampler}` sampler"
                 + (f" at {steps} steps" if steps else "") + f", guidance {guidance}"
                 + (f" (candidate `{candidate['name']}`)" if candidate else "") + ".", ""]
    else:
        lines = [f"# The `{student}` student, exported by distillery", "",
                 f"A {model_words(student_dir / 'model')} text-to-video model in diffusers layout: the transformer trained by the `{student}` stage "
                 f"(`{method}`), with the base's VAE, text encoder and tokenizer. It samples with the "
                 f"`{sampler}` sampler of `sampling.json`" + (f" at {steps} steps" if steps else "")
                 + f" (guidance {guidance})" + (f", as validate's candidate `{candidate['name']}`" if candidate else "")
                 + "."]
        lines += _nfe_lines(contract, metrics, candidate) + [""]
    lines += ["## Sampling settings (`sampling.json`)", "", "```json", json.dumps(contract, indent=2), "```", ""]
    lines += ["## How it was made (from `lineage.json`; `distillery lineage <this folder>` prints the whole tree)", "",
              "| stage | kind | method | its params | artifact digest |", "|---|---|---|---|---|"]
    for node in artifacts_once(manifest):
        node_method = (node.get("method") or "—").rsplit(".", 1)[-1]
        params = json.dumps(_own_params(node), sort_keys=True).replace("|", "/")
        lines.append(f"| {node.get('stage')} | {node.get('kind')} | {node_method} | `{params}` | "
                     f"`{str(node.get('manifest_sha256', ''))[:16]}` |")
    latency = _latency_context(report)
    lines += ["", f"## Validation (the validate stage: {len(report.get('prompts', []))} prompts × "
              f"{report.get('num_seeds', 1)} seeds, ± over seeds; reference `{reference}`)", ""]
    lines += _metrics_table(_candidates(student, metrics, reference), metrics, _COLUMNS + ((_LATENCY,) if latency else ()))
    lines += ["", f"Latencies were measured {latency}." if latency else
              "Latencies are left out: validate's report does not say on what machine and under what load they were "
              "measured (its `report.json` keeps them)."]
    lines += _vbench_lines(_candidates(student, metrics, reference), metrics)
    prompt, seed = report["prompts"][0], report["seeds"][0]
    size = f"num_frames={cfg['num_frames']}, height={cfg['height']}, width={cfg['width']}"
    call_args = (f"num_inference_steps={steps}, guidance_scale={guidance},{second}" if steps
                 else f"guidance_scale={guidance},{second}")
    marker = f"  # validate's {candidate['name']}" if candidate else ""
    installs = f"Install them (`pip install {' '.join(REQUIREMENTS)}`; this folder was made with {_versions()})"
    where = f"Run from the workspace root (or replace `{folder}` by where this folder is)."
    lines += ["", f"## Load and sample it (offline, needs only {_listed(REQUIREMENTS)})", ""]
    if cosmos:
        from distillery.export import cosmos_card  # imported for a Cosmos export only

        own = cosmos_card.own_pipeline_lines(folder, contract, prompt, size, report["max_sequence_length"], call_args,
                                             marker, seed)
        lines += [f"{installs}. {where} {own[0]}", *own[1:]]
        stock: list[str] = []
        if teacher and stock_samples(contract) and steps:
            stock = cosmos_card.stock_lines(folder, contract, prompt, size, report["max_sequence_length"], steps, guidance,
                                            candidate["name"] if candidate else None, seed)
        return "\n".join(front + lines + stock)
    if family == HUNYUAN15_FAMILY:
        from distillery.export import hunyuan15_card  # imported for a HunyuanVideo 1.5 export only

        own = hunyuan15_card.own_pipeline_lines(folder, contract, prompt, size, call_args, marker, seed)
        lines += [f"{installs}. {where} {own[0]}", *own[1:]]
        if teacher and stock_samples(contract) and steps:
            lines += hunyuan15_card.stock_lines(folder, contract, prompt, size, steps, guidance,
                                                candidate["name"] if candidate else None, seed)
        elif stock_nfe is not None:
            lines += hunyuan15_card.stock_lines(folder, contract, prompt, size, stock_nfe, 1.0, None, seed, fused_nfe=stock_nfe)
        return "\n".join(front + lines)
    lines += [f"{install_words()} {where} "
              "The folder's own modules "
              "(`pipeline.py` and the `distilled_*.py` it imports) do the sampling; nothing of distillery is imported. "
              "For this prompt and seed, at these steps and guidance, it returns the video validate scored."
              + ("" if stock_samples(contract, sparse is not None) else
                 " Its `model_index.json` names this pipeline (`_class_name`): stock `WanPipeline` would sample it "
                 "with the teacher's many-step loop, so diffusers loads it only with `trust_remote_code=True`, and "
                 "then as this pipeline.")]
    lines += ["",
              "`trust_remote_code=True` runs this folder's `pipeline.py`: verify the folder first, where distillery is "
              f"installed — `distillery lineage {folder} --verify --expect <the manifest digest published with the "
              "model>` re-hashes every file, the shipped code included, against the sealed `lineage.json` and refuses "
              "an edited `pipeline.py`; load it only when that says `verified`.", "",
              "```python", "import torch", "from diffusers import DiffusionPipeline", "from diffusers.utils import export_to_video",
              "", f'folder = "{folder}"',
              "pipe = DiffusionPipeline.from_pretrained(folder, custom_pipeline=folder, trust_remote_code=True)",
              f"video = pipe({json.dumps(prompt)}, {size}, max_sequence_length={report['max_sequence_length']},",
              f"            {call_args}{marker}",
              f"            generator=torch.Generator().manual_seed({seed})).frames[0]",
              *save_lines(float(cfg["fps"])), "```", ""]
    lines += latents_note(candidate)
    if not stock_samples(contract, sparse is not None):
        lines += _gpu_lines()
    if sparse:
        lines += [f"It trained with block-sparse attention: each query tile of {' × '.join(map(str, sparse['tile']))} "
                  f"tokens (frames × rows × columns) attends only the {1 - float(sparse['sparsity']):.0%} of the key tiles "
                  f"it scores highest (sparsity {float(sparse['sparsity']):g}; its `transformer/config.json`: "
                  "`_sparse_attention`). This pipeline samples it with that attention (`sparse_attention.py`, "
                  "FlashAttention-4's block-sparse kernel on a GPU where FA4 runs); stock diffusers would run it dense.", ""]
    if sampler == "causal_streaming":
        lines += ["### Frames as they come", "",
                  "It generates chunk by chunk: `for frames in pipe.stream(<the same arguments>): ...` yields each "
                  "finished chunk's frames (numpy `[1, f, H, W, 3]`) while the next chunk denoises; together they are the "
                  "frames the call above returns.", ""]
    stock = [] if sparse else _stock_snippet(teacher, contract, stock_nfe, report, folder, prompt, seed, size, steps,
                                             guidance, candidate, second)  # stock diffusers would run its attention dense
    return "\n".join(front + lines + stock)


def _gpu_lines() -> list[str]:
    """What the folder's pipeline does on a GPU and how to get its fast path (``distilled_fast.py``)."""
    return ["### On a GPU", "",
            "Load it in bf16 and move it to the GPU (`DiffusionPipeline.from_pretrained(folder, custom_pipeline=folder, "
            "trust_remote_code=True, dtype=torch.bfloat16).to(\"cuda\")`, a `torch.Generator(\"cuda\")`): the "
            "pipeline then runs FlashAttention-4 where `flash-attn-4` is installed (`pip install flash-attn-4`, or "
            "distillery's `[gpu]` extra; a Hopper or newer GPU), compiles each transformer block (the first video "
            "pays the compile) and decodes with the fused chunked VAE decoder in the VAE's dtype — each part only "
            "where it can run. Its first video prints one line saying which path it took. "
            "`pipe.configure_speed(attention=\"sdpa\", compile=\"off\", decode=\"stock\")` before the first video "
            "keeps diffusers' own kernels; `fp8=\"on\"` (needs `torchao`) runs the blocks' GEMMs in float8 — off by "
            "default: on one H200 it took a 4-step 81×480×832 video from 3.12 s to 3.03 s (denoising 1.78 → 1.63 s) "
            "and made the first video 138 s instead of 26 s (torchao's compile), moving frames by at most 7/255 "
            "(distillery's BENCHMARKS.md). On the CPU it is always the stock path, "
            "and it returns validate's latents bit for bit.", ""]


def _stock_snippet(teacher: bool, contract: dict[str, Any], stock_nfe: int | None, report: dict[str, Any], folder: str,
                   prompt: str, seed: int, size: str, steps: int | None, guidance: float,
                   candidate: dict[str, Any] | None, second: str = "") -> list[str]:
    """Stock ``WanPipeline`` on the folder, where a plain transformer is the model: the teacher (at the validated
    steps and guidance; ``second``: its `` guidance_scale_2=…,`` argument of two experts, or empty) and a fused PDD
    student (at ``stock_nfe``, no CFG)."""
    if teacher and contract.get("sampler") == "euler" and contract.get("chunk_size") is None and steps:
        intro = ("It is a stock Wan model: stock `WanPipeline` samples it with no code of the folder. With the Euler "
                 "scheduler of its shift (the base may ship another, e.g. UniPC) it returns validate's video:")
        nfe, scale, name = steps, guidance, candidate["name"] if candidate else None
    elif stock_nfe is not None:
        intro = (f"`transformer/` alone is the student at {stock_nfe} NFE fused into a plain transformer: stock "
                 "`WanPipeline` samples it with its shift's Euler scheduler (the folder's parts, loaded through its "
                 "own pipeline; stock code samples):")
        nfe, scale, second = stock_nfe, 1.0, ""
        names = [c["name"] for c in report.get("candidates", []) if c.get("sampler") == contract.get("sampler")
                 and int(c.get("num_steps", -1)) == stock_nfe]
        name = names[0] if names else None
    else:
        return []
    marker = f"  # validate's {name}" if name else ""
    if stock_samples(contract):
        imports, load = "FlowMatchEulerDiscreteScheduler, WanPipeline", [f'pipe = WanPipeline.from_pretrained("{folder}")']
    else:  # its model_index.json names its own pipeline (module doc of distillery.export.code): the parts through it
        imports = "DiffusionPipeline, FlowMatchEulerDiscreteScheduler, WanPipeline"
        load = [f'folder = "{folder}"',
                "parts = DiffusionPipeline.from_pretrained(folder, custom_pipeline=folder, trust_remote_code=True).components",
                "pipe = WanPipeline(**parts)"]
    return [intro, "", "```python", "import torch", f"from diffusers import {imports}", "from diffusers.utils import export_to_video",
            "", *load,
            f"pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift={contract.get('shift')})",
            f"video = pipe({json.dumps(prompt)}, {size}, max_sequence_length={report['max_sequence_length']},",
            f"            num_inference_steps={nfe}, guidance_scale={scale},{second}{marker}",
            f"            generator=torch.Generator().manual_seed({seed})).frames[0]",
            *save_lines(float(report["config"]["fps"])), "```", ""]
