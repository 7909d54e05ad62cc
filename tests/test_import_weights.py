"""``distillery import-weights``: a published checkpoint in Wan's original key layout as a diffusers folder
(issue 42 item 6). The file is written here from the tiny Wan the way the Self-Forcing repository saves
its ``ode_init.pt`` — ``torch.save({"generator": state_dict})`` of a ``model.``-wrapped ``WanModel`` — with
the original names written out by hand from Wan's module definitions (not from the converter's table)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from distillery.cli.guard import run_guarded
from distillery.cli.main import build_parser


def _original_name(diffusers: str) -> str:
    """Wan's own name of a diffusers ``WanTransformer3DModel`` tensor (Wan-AI's wan/modules/model.py)."""
    fixed = {"scale_shift_table": "head.modulation"}
    if diffusers in fixed:
        return fixed[diffusers]
    pairs = [(r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
             (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
             (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
             (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
             (r"^condition_embedder\.time_proj\.", "time_projection.1."),
             (r"^proj_out\.", "head.head."),
             (r"^(blocks\.\d+)\.scale_shift_table$", r"\1.modulation"),
             (r"^(blocks\.\d+)\.attn1\.to_out\.0\.", r"\1.self_attn.o."),
             (r"^(blocks\.\d+)\.attn2\.to_out\.0\.", r"\1.cross_attn.o."),
             (r"^(blocks\.\d+)\.attn1\.to_([qkv])\.", r"\1.self_attn.\2."),
             (r"^(blocks\.\d+)\.attn2\.to_([qkv])\.", r"\1.cross_attn.\2."),
             (r"^(blocks\.\d+)\.attn1\.norm_([qk])\.", r"\1.self_attn.norm_\2."),
             (r"^(blocks\.\d+)\.attn2\.norm_([qk])\.", r"\1.cross_attn.norm_\2."),
             (r"^(blocks\.\d+)\.norm2\.", r"\1.norm3."),
             (r"^(blocks\.\d+)\.ffn\.net\.0\.proj\.", r"\1.ffn.0."),
             (r"^(blocks\.\d+)\.ffn\.net\.2\.", r"\1.ffn.2.")]
    for pattern, repl in pairs:
        if re.match(pattern, diffusers):
            return re.sub(pattern, repl, diffusers)
    assert diffusers.startswith("patch_embedding."), diffusers
    return diffusers


def _tiny_state(tiny_base: Path) -> dict[str, torch.Tensor]:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(tiny_base / "transformer").state_dict()


def _cli(capsys, *args: str) -> tuple[int, str]:
    ns = build_parser().parse_args(["import-weights", *map(str, args)])
    capsys.readouterr()
    rc = run_guarded(lambda: ns.func(ns))
    return rc, capsys.readouterr().err.strip()


def test_a_self_forcing_style_file_becomes_the_same_transformer(tmp_path, tiny_base, capsys):
    from diffusers import WanTransformer3DModel

    state = _tiny_state(tiny_base)
    published = {"generator": {f"model.{_original_name(k)}": v.to(torch.bfloat16) for k, v in state.items()},
                 "critic": {"model.x": torch.zeros(1)}}
    torch.save(published, tmp_path / "ode_init.pt")
    rc, err = _cli(capsys, tmp_path / "ode_init.pt", "--like", tiny_base, "--out", tmp_path / "init")
    assert rc == 0, err
    loaded = WanTransformer3DModel.from_pretrained(tmp_path / "init" / "transformer", torch_dtype=torch.bfloat16).state_dict()
    assert set(loaded) == set(state)
    assert all(torch.equal(loaded[k], state[k].to(torch.bfloat16)) for k in state)
    record = json.loads((tmp_path / "init" / "imported_from.json").read_text())
    assert record["entry"] == "generator" and record["tensors"] == len(state)
    assert (tmp_path / "init" / "scheduler" / "scheduler_config.json").is_file()
    from distillery.models.wan.common import locate_transformer

    assert locate_transformer(tmp_path / "init")[0] == tmp_path / "init" / "transformer"  # any init_from takes it


class _Payload:
    def __reduce__(self):
        return (exec, ("open('MARKER', 'w').write('ran')",))


@pytest.mark.parametrize("case", ["pickle", "other-width", "missing", "foreign-key", "out-exists"])
def test_a_file_that_is_not_this_transformer_is_one_line(tmp_path, tiny_base, capsys, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    state = {_original_name(k): v for k, v in _tiny_state(tiny_base).items()}
    words = {"pickle": "does not load as tensors alone", "other-width": "a checkpoint of another model size",
             "missing": "not given", "foreign-key": "has no place", "out-exists": "exists: name a new folder"}[case]
    if case == "pickle":
        torch.save({"generator": state, "hook": _Payload()}, tmp_path / "ckpt.pt")
    elif case == "other-width":
        state["head.head.weight"] = torch.zeros(3, 3)
    elif case == "missing":
        state.pop("blocks.0.ffn.2.weight")
    elif case == "foreign-key":
        state["img_emb.proj.0.weight"] = torch.zeros(2)
    if case != "pickle":
        torch.save(state, tmp_path / "ckpt.pt")
    out = tmp_path / "init"
    if case == "out-exists":
        out.mkdir()
        (out / "mine.txt").write_text("keep")
    rc, err = _cli(capsys, tmp_path / "ckpt.pt", "--like", tiny_base, "--out", out)
    lines = err.splitlines()
    assert rc == 2 and len(lines) == 1 and words in lines[0], err
    assert not (tmp_path / "MARKER").exists()
    assert (case == "out-exists" and (out / "mine.txt").read_text() == "keep") or not out.exists()
    assert not list(tmp_path.glob(".init.tmp*"))


@pytest.mark.slow
def test_an_imported_ode_init_is_published_as_pretrain_and_distill_starts_from_it(prepared, tmp_path, capsys):
    """``pretrain.source: given`` + ``pretrain.path``: the imported folder is the pretrain artifact untrained — its
    transformer byte for byte, the causal recipe's contract (``chunk_size``), the import record kept, the lineage's
    ``weights: given`` — and ``distill`` (Self-Forcing) starts from it (issue 42 item 6, through the real stages)."""
    from workspace import copy_workspace, set_params, sh, stage

    base = prepared / "artifacts" / "base" / "model"
    gen = torch.Generator().manual_seed(5)
    state = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in _tiny_state(base).items()}
    torch.save({"generator": {f"model.{_original_name(k)}": v for k, v in state.items()}}, tmp_path / "ode_init.pt")
    rc, err = _cli(capsys, tmp_path / "ode_init.pt", "--like", base, "--out", tmp_path / "ode-init")
    assert rc == 0, err
    repo = copy_workspace(prepared, tmp_path / "ws")
    set_params(repo, {"teacher.source": "base", "pretrain.source": "given", "pretrain.path": str(tmp_path / "ode-init"),
                      "pretrain.chunk_size": 2, "distill.steps": 2})
    sh(["git", "commit", "-qam", "given pretrain"], repo)
    for name in ("teacher", "pretrain", "distill"):
        stage(repo, name, check=True)
    model = repo / "artifacts" / "pretrain" / "model"
    imported = sorted(p.relative_to(tmp_path / "ode-init" / "transformer") for p in (tmp_path / "ode-init" / "transformer").rglob("*")
                      if p.is_file())
    assert imported and all((model / "transformer" / f).read_bytes() == (tmp_path / "ode-init" / "transformer" / f).read_bytes()
                            for f in imported)
    assert json.loads((model / "sampling.json").read_text())["chunk_size"] == 2
    assert json.loads((model / "imported_from.json").read_text())["entry"] == "generator"
    lineage = json.loads((repo / "artifacts" / "pretrain" / "lineage.json").read_text())
    assert lineage["weights"]["source"] == "given" and [i["role"] for i in lineage["inputs"]] == ["source"]
    assert not (repo / "runs" / "pretrain").exists()
    distill = json.loads((repo / "artifacts" / "distill" / "lineage.json").read_text())
    assert {i["role"]: i["path"] for i in distill["inputs"]}["student_init"] == "artifacts/pretrain"


@pytest.mark.parametrize("given, says", [({"pretrain.source": "given"}, "pretrain.source: given needs pretrain.path"),
                                         ({"pretrain.path": "somewhere"}, "needs pretrain.source: given")])
def test_a_given_pretrain_without_its_folder_or_a_folder_without_given_is_one_line(given, says):
    import yaml

    from distillery.common.errors import UserError
    from distillery.pipeline.params.loading import validate_params

    params = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    for dotted, value in given.items():
        section, key = dotted.split(".")
        params[section][key] = value
    with pytest.raises(UserError, match=says):
        validate_params(params)
