"""FastVideo 0.2.1's own training-method code, run on our tiny models and tensors: the reference of the differential
tests of causal consistency distillation and Teacher-Forcing SFT (tests/test_causal_cd.py, tests/test_tfsft.py).

FastVideo is not a dependency of distillery. :func:`fastvideo_site` fetches its wheel with pip (``pip download
--no-deps fastvideo==0.2.1``, the package registry), unpacks it, and installs into the same cache folder the two real
packages its method modules import that our environment lacks (``einops``, ``remote-pdb``); then this file runs, as
its own process, with that folder on its path (:func:`run_oracle`).

What runs is FastVideo's code, unchanged: ``fastvideo/train/methods/consistency_model/causal_cd.py``,
``fine_tuning/tfsft.py`` and ``dfsft.py``, their base class ``fastvideo/train/methods/base.py``, the optimizer builder,
the self-forcing and flow-match schedulers, and the teacher-forcing attention mask of its causal Wan
(``CausalWanTransformer3DModel._prepare_teacher_forcing_mask``). Three things are set up around it, and only these:

- **three package ``__init__`` files are not run**: ``fastvideo``, ``fastvideo.train`` and ``fastvideo.training``
  only re-export (the inference pipelines, the trainer, the distillation pipelines); they are registered as bare
  packages over their real folders, so every module below them imports from its own file;
- **one import is a stand-in**: ``torchvision.utils.make_grid``, imported by ``fastvideo/utils.py`` for writing
  validation grids and never called here. torchvision cannot be installed beside our torch: its wheels on the
  registry are CUDA builds whose C ops do not load against the CPU build of torch 2.13 (``operator torchvision::nms
  does not exist``); transformers and diffusers are imported first, so they see no torchvision at all;
- **the model side is ours**: FastVideo's methods call a per-role model interface (``prepare_batch``,
  ``predict_noise(..., clean_x=)``, ``add_noise``, ``backward``); :class:`FVModel` answers it with our tiny model
  plugins in FastVideo's ``[B, T, C, H, W]`` layout (teacher forcing through our
  ``predict_noise_teacher_forcing``), and its ``add_noise`` is FastVideo's ``WanModel.add_noise`` (its scheduler's
  ``add_noise`` over frames) written out, because FastVideo's ``WanModel`` module does not import without the
  inference stack. The differential tests therefore compare the *methods* — draws' use, grids, guidance, the Euler
  step, the target, the losses and their gradients, the EMA update — on identical networks; the attention mask is
  compared on its own (``mask``).

Usage (this process): ``python fastvideo_oracle.py SITE SPECS.pt OUT.pt``; each spec names a ``job`` (``causal_cd`` |
``tfsft`` | ``mask``) and its inputs; each output holds FastVideo's loss, the student's gradients, the draws it made,
and (causal_cd) the student and its EMA target after one optimizer step.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

FASTVIDEO = "fastvideo==0.2.1"
DEPS = ("einops==0.8.2", "remote-pdb==2.1.0")  # what FastVideo's method modules import that our environment lacks
SKIPPED_INITS = ("fastvideo", "fastvideo.train", "fastvideo.training")


def fastvideo_site(cache: Path) -> Path:
    """A folder holding FastVideo 0.2.1's unpacked wheel and its two missing imports (built once, atomically)."""
    site = cache / "fastvideo-0.2.1-site"
    if (site / "fastvideo" / "train" / "methods" / "consistency_model" / "causal_cd.py").is_file():
        return site
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".site-{os.getpid()}"
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "download", "--no-deps", FASTVIDEO, "-d", str(tmp / "wheel")], check=True, timeout=600)
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp / "site"), *DEPS], check=True, timeout=600)
    wheel = next((tmp / "wheel").glob("fastvideo-0.2.1-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp / "site")
    try:
        os.rename(tmp / "site", site)
    except OSError:  # another worker finished first
        pass
    return site


def run_oracle(site: Path, specs: list[dict[str, Any]], folder: Path) -> list[dict[str, Any]]:
    """Run each of ``specs`` through FastVideo's code, in one process of its own; returns their outputs in order."""
    import torch

    spec_path, out_path = folder / "oracle-spec.pt", folder / "oracle-out.pt"
    torch.save(specs, spec_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, str(site), str(spec_path), str(out_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out_path)


# ---------------------------------------------------------------------------------------------------------------
# the oracle process
# ---------------------------------------------------------------------------------------------------------------
def _bootstrap(site: Path) -> None:
    """The module doc's three set-ups, before any FastVideo import."""
    from diffusers.loaders import lora_base  # noqa: F401  (transformers' and diffusers' own imports settle first:
    from transformers import PreTrainedModel  # noqa: F401   they find no torchvision)

    grid = types.ModuleType("torchvision.utils")

    def make_grid(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("torchvision.utils.make_grid is a stand-in in the FastVideo oracle")

    grid.make_grid = make_grid
    vision = types.ModuleType("torchvision")
    vision.utils = grid
    vision.__path__ = []
    sys.modules.update({"torchvision": vision, "torchvision.utils": grid})
    for name in SKIPPED_INITS:
        package = types.ModuleType(name)
        package.__path__ = [str(site / name.replace(".", "/"))]
        sys.modules[name] = package


class FVModel:
    """FastVideo's per-role model interface (what its methods call) over one of our model plugins (module doc)."""

    def __init__(self, ours: Any, trainable: bool, scheduler: Any = None) -> None:
        import torch

        self.ours = ours
        self.transformer = ours.transformer
        self._trainable = trainable
        self.attention_backend_name = "TORCH_SDPA"
        self.device = torch.device("cpu")
        self.noise_scheduler = scheduler
        self.num_train_timesteps = ours.schedule.num_train_timesteps

    def init_preprocessors(self, training_config: Any) -> None:
        del training_config

    def prepare_batch(self, batch: dict[str, Any], generator: Any = None, latents_source: str = "data") -> Any:
        """The batch in FastVideo's layout; draws nothing (the noise, where a method reads it, is the spec's)."""
        from distillery.models.base import Conditioning

        del generator, latents_source
        return types.SimpleNamespace(latents=batch["latents"].permute(0, 2, 1, 3, 4), timesteps=None, noise=batch.get("noise"),
                                     attn_metadata=None, attn_metadata_vsa=None,
                                     cond=Conditioning(batch["text_embeds"], batch["negative_text_embeds"]))

    def predict_noise(self, noisy_latents: Any, timestep: Any, batch: Any, *, conditional: bool, cfg_uncond: Any = None,
                      attn_kind: str = "dense", clean_x: Any = None, aug_t: Any = None) -> Any:
        from distillery.models.base import CausalModelBase

        del cfg_uncond, attn_kind
        assert aug_t is None
        x = noisy_latents.permute(0, 2, 1, 3, 4)
        if clean_x is not None and isinstance(self.ours, CausalModelBase):
            v = self.ours.predict_noise_teacher_forcing(x, timestep, batch.cond, clean_x.permute(0, 2, 1, 3, 4),
                                                        conditional=conditional)
        else:
            v = self.ours.predict_noise(x, timestep, batch.cond, conditional=conditional)
        return v.permute(0, 2, 1, 3, 4)

    def add_noise(self, clean_latents: Any, noise: Any, timestep: Any) -> Any:
        """FastVideo's ``WanModel.add_noise``: its scheduler's ``add_noise`` over the frames."""
        b, t = clean_latents.shape[:2]
        return self.noise_scheduler.add_noise(clean_latents.flatten(0, 1), noise.flatten(0, 1), timestep).unflatten(0, (b, t))

    def backward(self, loss: Any, ctx: Any, grad_accum_rounds: int = 1) -> None:
        del ctx
        (loss / grad_accum_rounds).backward()


def _cfg(spec: dict[str, Any]) -> Any:
    """FastVideo's run config, as much of it as its methods' ``__init__`` reads."""
    ns = types.SimpleNamespace
    optimizer = ns(learning_rate=spec["lr"], betas=(0.9, 0.999), weight_decay=0.0, lr_scheduler="constant",
                   lr_warmup_steps=0, lr_num_cycles=1, lr_power=1.0, min_lr_ratio=0.0)
    training = ns(optimizer=optimizer, loop=ns(max_train_steps=10), pipeline_config=ns(flow_shift=spec["shift"]),
                  distributed=ns(sp_size=1), model=ns(precondition_outputs=False), data=ns(seed=0))
    return ns(training=training, method=dict(spec["method"]))


def _models(spec: dict[str, Any]) -> dict[str, Any]:
    from distillery.models.wan.causal import CausalWanModel, CausalWanModelConfig

    def causal(trainable: bool, role: str) -> Any:
        model = CausalWanModel(CausalWanModelConfig(init_from=spec["base"], trainable=trainable,
                                                    chunk_size=spec["chunk_size"]), role)
        model.transformer.load_state_dict(spec["weights"][role])
        return model

    return {role: causal(role == "student", role) for role in spec["weights"]}


def _grads(model: Any) -> dict[str, Any]:
    return {n: p.grad.detach().clone() for n, p in model.transformer.named_parameters() if p.grad is not None}


def _causal_cd(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from fastvideo.train.methods.consistency_model.causal_cd import CausalConsistencyDistillationMethod

    ours = _models(spec)
    roles = {"student": FVModel(ours["student"], True), "teacher": FVModel(ours["teacher"], False),
             "ema": FVModel(ours["ema"], False)}
    method = CausalConsistencyDistillationMethod(cfg=_cfg(spec), role_models=roles)
    method.cuda_generator = torch.Generator().manual_seed(spec["seed"])
    state = method.cuda_generator.get_state()
    loss_map, outputs, _ = method.single_train_step(spec["batch"], 1)
    method.backward(loss_map, outputs)
    grads = _grads(ours["student"])
    replay = torch.Generator().manual_seed(0)
    replay.set_state(state)  # the draws single_train_step made, in its order
    index = int(torch.randint(0, method._discrete_cd_n - 1, (1,), generator=replay).item())
    noise = torch.randn(roles["student"].prepare_batch(spec["batch"]).latents.shape, generator=replay)
    method.optimizers_schedulers_step(spec["iteration"])  # the student's AdamW step, then its EMA update
    return {"loss": loss_map["total_loss"].detach(), "grads": grads, "index": index, "noise": noise.permute(0, 2, 1, 3, 4),
            "timesteps": method._sf_scheduler.timesteps.clone(),
            "student_after": {n: p.detach().clone() for n, p in ours["student"].transformer.named_parameters()},
            "ema_after": {n: p.detach().clone() for n, p in ours["ema"].transformer.named_parameters()}}


def _tfsft(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from fastvideo.models.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
    from fastvideo.train.methods.fine_tuning.tfsft import TeacherForcingSFTMethod

    ours = _models(spec)
    student = FVModel(ours["student"], True, FlowMatchEulerDiscreteScheduler(shift=spec["shift"]))
    method = TeacherForcingSFTMethod(cfg=_cfg(spec), role_models={"student": student})
    method.cuda_generator = torch.Generator().manual_seed(spec["seed"])
    state = method.cuda_generator.get_state()
    loss_map, outputs, _ = method.single_train_step(spec["batch"], 1)
    method.backward(loss_map, outputs)
    replay = torch.Generator().manual_seed(0)
    replay.set_state(state)
    b, c, t = spec["batch"]["latents"].shape[:3]
    low, high = method._timestep_index_range
    chunks = (t + method._chunk_size - 1) // method._chunk_size
    index = torch.randint(low, high, (b, chunks), generator=replay).repeat_interleave(method._chunk_size, dim=1)[:, :t]
    return {"loss": loss_map["total_loss"].detach(), "grads": _grads(ours["student"]), "index": index,
            "timesteps": student.noise_scheduler.timesteps.clone(), "weights": method._training_weights.clone()}


def _mask(spec: dict[str, Any]) -> dict[str, Any]:
    """FastVideo's teacher-forcing mask, token by token: its ``mask_mod`` captured from ``create_block_mask`` and
    evaluated on every (query, key) pair of the unpadded ``[clean | noisy]`` sequence."""
    import fastvideo.models.dits.causal_wanvideo as causal_wanvideo
    import torch

    captured: dict[str, Any] = {}

    def capture(mask_mod: Any, **kwargs: Any) -> None:
        captured["mask_mod"] = mask_mod

    causal_wanvideo.create_block_mask = capture
    frames, tokens = spec["frames"], spec["tokens_per_frame"]
    causal_wanvideo.CausalWanTransformer3DModel._prepare_teacher_forcing_mask(
        device="cpu", num_frames=frames, frame_seqlen=tokens, num_frame_per_block=spec["chunk_size"])
    length = 2 * frames * tokens
    q = torch.arange(length)[:, None]
    kv = torch.arange(length)[None, :]
    return {"mask": captured["mask_mod"](0, 0, q, kv)}


if __name__ == "__main__":
    import torch

    site, spec_file, out_file = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    _bootstrap(site)
    jobs = {"causal_cd": _causal_cd, "tfsft": _tfsft, "mask": _mask}
    results = []
    for job_spec in torch.load(spec_file):
        with torch.enable_grad():
            results.append(jobs[job_spec["job"]](job_spec))
    torch.save(results, out_file)
