"""Records vbench 0.1.5's own numbers for the faithfulness test: run in a venv of vbench's pins, not the project's.

    python3.11 -m venv VENV && VENV/bin/pip install torch==2.14.1 torchvision==0.29.1 'numpy<2' transformers==4.33.2 \
        'timm<=1.0.12,>=0.9' opencv-python-headless decord openai-clip easydict omegaconf einops scipy pillow tqdm ftfy \
        regex pyyaml && VENV/bin/pip install --no-deps vbench==0.1.5 pyiqa==0.1.13 && VENV/bin/pip install addict future \
        lmdb pandas scikit-image yapf icecream
    VENV/bin/python tests/vbench_faithfulness/make_reference.py --dino-repo DIR [--out tests/vbench_faithfulness/reference.json]

``--dino-repo``: a checkout of facebookresearch/dino (``vision_transformer.py``, ``utils.py``), whose hub entry
VBench loads. Each dimension is vbench's own function (``subject_consistency``,
``background_consistency``, ``cal_score``, ``MotionSmoothness.motion_score``, ``DynamicDegree.infer``,
``laion_aesthetic``, ``technical_quality``, ``overall_consistency``) on its own model classes (DINO's hub
``VisionTransformer``, OpenAI ``clip``'s CLIP built as ``clip.load`` builds a state dict (``build_model``, then float32
on the CPU), AMT-S, RAFT, pyiqa's MUSIQ, ViCLIP), filled by
``common.fill`` with the same values the test gives ours. Only the file readers are replaced — by functions returning
what vbench's readers return for these frames — so both sides see the same frames. The OpenAI CLIPs and ViCLIP's
towers and DINO's ViT are small (the same classes: DINO's ViT-Tiny/16, ViCLIP's towers swapped into vbench's
``ViCLIP``, whose constructor is fixed to L/14); AMT-S, RAFT and MUSIQ are at their published sizes. The tokenizer check compares vbench's
``SimpleTokenizer`` with ours on CLIP's real vocabulary (shipped in ``openai-clip``) for every suite prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
CACHE = Path(tempfile.mkdtemp(prefix="vbench-cache-"))
os.environ["VBENCH_CACHE_DIR"] = str(CACHE)

import common  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402


def shapes_of(module: torch.nn.Module) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in module.state_dict().items()}


def filled(shapes: dict[str, list[int]], seed: int, half: bool = False) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in common.fill(shapes, seed, half).items()}


def as_loaded(frames: np.ndarray) -> torch.Tensor:
    """What vbench's ``load_video`` returns for these frames (a float32 ``[T, C, H, W]`` tensor)."""
    return torch.Tensor(frames).permute(0, 3, 1, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dino-repo", required=True)
    parser.add_argument("--out", default=str(HERE / "reference.json"))
    parser.add_argument("--only", nargs="*", default=None, help="record only these sections (to debug; the test needs all)")
    args = parser.parse_args()

    def want(section: str) -> bool:
        return args.only is None or section in args.only
    torch.set_grad_enabled(False)
    videos = common.clips()
    names = list(videos)
    common.write_bpe(CACHE / "ViCLIP" / "bpe_simple_vocab_16e6.txt.gz")
    record: dict = {"torch": torch.__version__, "numpy": np.__version__, "shapes": {}, "videos": {n: {} for n in names},
                    "aggregate": {}, "seeds": {}}
    import importlib.metadata as md

    record["vbench"] = md.version("vbench")
    record["pyiqa"] = md.version("pyiqa")

    def put(dim: str, results: list[dict]) -> None:
        for r in results:
            record["videos"][Path(r["video_path"]).stem][dim] = float(r["video_results"])

    if want("subject"):
        # subject consistency: DINO's VisionTransformer from its repo (vbench loads ViT-B/16 of it through torch.hub; the
        # ViT-Tiny/16 of the same class keeps the test quick)
        import vbench.subject_consistency as sc

        sys.path.insert(0, args.dino_repo)
        import vision_transformer as dino_vits

        dino = dino_vits.vit_tiny(patch_size=16, num_classes=0)
        record["shapes"]["dino"] = shapes_of(dino)
        dino.load_state_dict(filled(record["shapes"]["dino"], common.SEED + 1))
        dino.eval()
        sc.load_video = lambda p: as_loaded(videos[Path(p).stem])
        agg, res = sc.subject_consistency(dino, [f"{n}.mp4" for n in names], "cpu", False)
        put("subject_consistency", res)
        record["aggregate"]["subject_consistency"] = agg

    if want("clip"):
        # background consistency / aesthetic quality: OpenAI CLIP through clip.load (a state-dict file)
        import clip
        import vbench.aesthetic_quality as aq
        import vbench.background_consistency as bc

        def clip_load(path: Path):
            """clip.load's state-dict branch (its torch.jit attempt leaves the file at its end on this torch)."""
            return clip.model.build_model(torch.load(path, map_location="cpu")).to("cpu").float(), None

        def tiny_clip(patch: int, seed: int, key: str) -> Path:
            model = clip.model.CLIP(embed_dim=32, image_resolution=224, vision_layers=2, vision_width=64, vision_patch_size=patch,
                                    context_length=77, vocab_size=49408, transformer_width=64, transformer_heads=1,
                                    transformer_layers=2)
            record["shapes"][key] = shapes_of(model)
            path = CACHE / f"{key}.pt"
            torch.save(filled(record["shapes"][key], seed, half=True), path)
            return path

        clip_b, _ = clip_load(tiny_clip(32, common.SEED + 2, "clip_b32"))
        bc.load_video = lambda p: as_loaded(videos[Path(p).stem])
        agg, res = bc.background_consistency(clip_b, None, [f"{n}.mp4" for n in names], "cpu", False)
        put("background_consistency", res)
        record["aggregate"]["background_consistency"] = agg

        clip_l, _ = clip_load(tiny_clip(14, common.SEED + 3, "clip_l14"))
        head = torch.nn.Linear(32, 1)
        record["shapes"]["aesthetic"] = shapes_of(head)
        head.load_state_dict(filled(record["shapes"]["aesthetic"], common.SEED + 4))
        aq.load_video = lambda p: as_loaded(videos[Path(p).stem])
        agg, res = aq.laion_aesthetic(head, clip_l, [f"{n}.mp4" for n in names], "cpu")
        put("aesthetic_quality", res)
        record["aggregate"]["aesthetic_quality"] = agg

    if want("flicker"):
        # temporal flickering: vbench reads frames with cv2 (BGR); the MAE does not depend on the channel order
        import vbench.temporal_flickering as tf

        tf.get_frames = lambda p: [f for f in videos[Path(p).stem]]
        for n in names:
            record["videos"][n]["temporal_flickering"] = tf.cal_score(f"{n}.mp4")

    if want("amt"):
        # motion smoothness: AMT-S at its published size
        import vbench.motion_smoothness as ms
        from omegaconf import OmegaConf
        from vbench.third_party.amt.utils.build_utils import build_from_cfg

        amt_cfg = str(Path(ms.__file__).parent / "third_party/amt/cfgs/AMT-S.yaml")
        amt = build_from_cfg(OmegaConf.load(amt_cfg).network)
        record["shapes"]["amt"] = shapes_of(amt)
        torch.save({"state_dict": filled(record["shapes"]["amt"], common.SEED + 5)}, CACHE / "amt-s.pth")
        smooth = ms.MotionSmoothness(amt_cfg, str(CACHE / "amt-s.pth"), "cpu")
        smooth.fp.get_frames = lambda p: [f for f in videos[Path(p).stem]]
        for n in names:
            record["videos"][n]["motion_smoothness"] = float(smooth.motion_score(f"{n}.mp4"))

    if want("raft"):
        # dynamic degree: RAFT at its published size, fps 16 (every 2nd frame), plus each pair's flow score
        import vbench.dynamic_degree as dd
        from easydict import EasyDict
        from vbench.third_party.RAFT.core.raft import RAFT
        from vbench.third_party.RAFT.core.utils_core.utils import InputPadder

        raft_args = EasyDict({"model": str(CACHE / "raft-things.pth"), "small": False, "mixed_precision": False, "alternate_corr": False})
        record["shapes"]["raft"] = shapes_of(RAFT(EasyDict(dict(raft_args))))
        torch.save({"module." + k: v for k, v in filled(record["shapes"]["raft"], common.SEED + 6).items()}, raft_args.model)
        dyn = dd.DynamicDegree(raft_args, "cpu")

        def raft_frames(p: str) -> list[torch.Tensor]:
            interval = max(1, round(common.FPS / 8))
            frames = [torch.from_numpy(f.astype(np.uint8)).permute(2, 0, 1).float()[None] for f in videos[Path(p).stem]]
            return dyn.extract_frame(frames, interval)

        dyn.get_frames = raft_frames
        for n in names:
            record["videos"][n]["dynamic_degree"] = float(dyn.infer(f"{n}.mp4"))
            frames, scores = raft_frames(f"{n}.mp4"), []
            for a, b in zip(frames[:-1], frames[1:]):
                padder = InputPadder(a.shape)
                a, b = padder.pad(a, b)
                _, flow = dyn.model(a, b, iters=20, test_mode=True)
                scores.append(float(dyn.get_score(a, flow)))
            record["videos"][n]["dynamic_degree_pair_scores"] = scores

    if want("musiq"):
        # imaging quality: pyiqa's MUSIQ at its published size
        import vbench.imaging_quality as iq
        from pyiqa.archs.musiq_arch import MUSIQ

        musiq_shapes = shapes_of(MUSIQ(pretrained=False))
        record["shapes"]["musiq"] = musiq_shapes
        torch.save(filled(musiq_shapes, common.SEED + 7), CACHE / "musiq.pth")
        musiq = MUSIQ(pretrained_model_path=str(CACHE / "musiq.pth"))
        musiq.training = False
        iq.load_video = lambda p: as_loaded(videos[Path(p).stem])
        agg, res = iq.technical_quality(musiq, [f"{n}.mp4" for n in names], "cpu")
        put("imaging_quality", res)  # per video before vbench's /100
        record["aggregate"]["imaging_quality"] = agg

    if want("viclip"):
        # overall consistency: vbench's ViCLIP with small towers of its own classes
        import vbench.overall_consistency as oc
        from vbench.third_party.ViCLIP.simple_tokenizer import SimpleTokenizer
        from vbench.third_party.ViCLIP.viclip import ViCLIP
        from vbench.third_party.ViCLIP.viclip_text import CLIP_TEXT
        from vbench.third_party.ViCLIP.viclip_vision import VisionTransformer
        from vbench.utils import get_frame_indices

        tokenizer = SimpleTokenizer(str(CACHE / "ViCLIP" / "bpe_simple_vocab_16e6.txt.gz"))
        viclip = ViCLIP(tokenizer=tokenizer, pretrain=None)
        viclip.vision_encoder = VisionTransformer(input_resolution=224, patch_size=14, width=64, layers=2, heads=4, output_dim=32,
                                                  kernel_size=1, num_frames=8).eval()
        viclip.text_encoder = CLIP_TEXT(32, 32, 49408, 64, 4, 2, 0).eval()
        record["shapes"]["viclip"] = shapes_of(viclip)
        viclip.load_state_dict(filled(record["shapes"]["viclip"], common.SEED + 8))

        def decord_frames(p: str, num_frames: int = 8, sample: str = "middle") -> torch.Tensor:
            frames = videos[Path(p).stem]
            idx = get_frame_indices(num_frames, len(frames), sample=sample)
            return torch.from_numpy(frames[idx]).permute(0, 3, 1, 2)  # uint8, as decord's torch bridge gives

        oc.read_frames_decord_by_fps = decord_frames
        video_dict = [{"prompt": common.PROMPTS[i % len(common.PROMPTS)], "video_list": [f"{n}.mp4"]} for i, n in enumerate(names)]
        agg, res = oc.overall_consistency(viclip, video_dict, tokenizer, "cpu")
        put("overall_consistency", res)
        record["aggregate"]["overall_consistency"] = agg
        record["viclip_token_ids"] = {p: viclip.text_encoder.tokenize(p, context_length=32)[0].tolist() for p in common.PROMPTS}

    if want("bpe"):
        # the tokenizer on CLIP's real vocabulary: vbench's SimpleTokenizer vs ours, every suite prompt
        sys.path.insert(0, str(HERE.parents[1] / "src"))
        import clip
        from vbench.third_party.ViCLIP.simple_tokenizer import SimpleTokenizer

        from distillery.evaluation.vbench.bpe import ClipBPE

        real = Path(clip.__file__).parent / "bpe_simple_vocab_16e6.txt.gz"
        theirs, ours = SimpleTokenizer(str(real)), ClipBPE(real)
        suite = json.loads((HERE.parents[1] / "src/distillery/assets/vbench/VBench_full_info.json").read_text())
        prompts = [e["prompt_en"] for e in suite]
        same = sum(theirs.encode(p) == ours.encode(p) for p in prompts)
        record["tokenizer_real_vocab"] = {"prompts": len(prompts), "identical": same}
    if want("pixels"):  # the preprocessing at real shapes (the clips above are small): vbench's transforms vs ours
        sys.path.insert(0, str(HERE.parents[1] / "src"))
        from vbench.imaging_quality import transform as musiq_transform
        from vbench.utils import clip_transform, dino_transform

        from distillery.evaluation.vbench import frames as ours

        rng = np.random.default_rng(common.SEED)
        record["pixels"] = {}
        for h, w in ((480, 832), (832, 480), (224, 224), (720, 1280)):
            v = rng.integers(0, 256, size=(2, h, w, 3), dtype=np.uint8)
            loaded, decord = as_loaded(v), torch.from_numpy(v).permute(0, 3, 1, 2)
            mine = ours.as_tensor(v)
            record["pixels"][f"{h}x{w}"] = {
                "clip": float((clip_transform(224)(loaded) - ours.clip_pixels(mine)).abs().max()),
                "clip_uint8": float((clip_transform(224)(decord) - ours.clip_pixels(mine, integer=True)).abs().max()),
                "dino": float((dino_transform(224)(loaded) - ours.dino_pixels(mine)).abs().max()),
                "musiq": float((musiq_transform(loaded, "longer") - ours.musiq_pixels(mine)).abs().max())}
        from vbench.utils import get_frame_indices

        record["middle_indices"] = {n: [int(i) for i in get_frame_indices(8, n, sample="middle")] for n in (5, 8, 9, 17, 81)}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("vbench", "pyiqa", "torch", "aggregate", "tokenizer_real_vocab")}, indent=1))


if __name__ == "__main__":
    main()
