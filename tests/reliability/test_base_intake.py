"""A base folder that would hang, exhaust or crash the stages is refused where it is taken in (issue 46 E, H, 3, 4).

Each case is a copy of the shipped tiny Wan with one injection, named by ``base.path``; ``distillery params
check`` and ``distillery stage base`` (in process, through the real parser and its error guard) must both
end in one line and exit 2 — before the base stage copies anything — where they hung (a FIFO), copied
until the disk was full (a link to ``/dev/zero``), recursed (a link loop), accepted 1 GiB of tokenizer,
or let diffusers fail later with a traceback (a safetensors header that lies).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import yaml

SHIPPED = (Path(__file__).resolve().parents[2] / "params.yaml").read_text()
VAE_WEIGHTS = "vae/diffusion_pytorch_model.safetensors"


def _params_with_base(base: Path) -> str:
    params = yaml.safe_load(SHIPPED)
    params["base"]["path"] = str(base)
    return yaml.safe_dump(params, sort_keys=False)


def _inject(base: Path, kind: str) -> str:
    """Make the injection ``kind`` in the copy ``base``; return the words the error line must hold."""
    if kind == "fifo":
        os.mkfifo(base / "vae" / "pipe")
        return "vae/pipe is a named pipe"
    if kind == "dev-zero":
        (base / "text_encoder" / "zeros.bin").symlink_to("/dev/zero")
        return "text_encoder/zeros.bin is a character device through a symbolic link"
    if kind == "loop-to-parent":
        (base / "vae" / "loop").symlink_to(".", target_is_directory=True)
        return "vae/loop links back to a folder above it"
    if kind == "self-link":
        (base / "tokenizer" / "self").symlink_to("self")
        return "tokenizer/self is a symbolic link loop"
    if kind == "huge-tokenizer":
        with open(base / "tokenizer" / "tokenizer.json", "r+b") as fh:  # sparse: no disk used
            fh.truncate(1 << 30)
        return "tokenizer/tokenizer.json is 1073741824 bytes"
    path = base / VAE_WEIGHTS
    size = path.stat().st_size
    if kind == "header-2^63":
        with open(path, "r+b") as fh:
            fh.write(struct.pack("<Q", 1 << 63))
        return f"{VAE_WEIGHTS} is not a valid safetensors file: its header claims {1 << 63} bytes"
    if kind == "header-100MB":
        with open(path, "r+b") as fh:
            fh.write(struct.pack("<Q", 100 * 10**6 + 1))
        return f"its header claims {100 * 10**6 + 1} bytes (the file has {size}"
    if kind == "offsets-outside":
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"][1] += 1 << 40
        text = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
        return "outside the file's"
    raise ValueError(kind)


CASES = ["fifo", "dev-zero", "loop-to-parent", "self-link", "huge-tokenizer", "header-2^63", "header-100MB", "offsets-outside"]


@pytest.mark.reliability(case="10.E", title="a base folder that would hang, exhaust or crash the stages",
                         injected="a copy of the tiny base with, one at a time: a FIFO in vae/; a symlink to /dev/zero; "
                                  "vae/loop -> .; a link to itself; a 1 GiB tokenizer.json; the VAE's safetensors header "
                                  "length 2^63, then 100 MB + 1; a tensor's data offsets past the file",
                         expect="`distillery params check` and `distillery stage base` each: exit 2, one line naming the file "
                                "and what it is, no hang, nothing copied into artifacts/")
@pytest.mark.parametrize("kind", CASES)
def test_a_base_that_would_hang_or_crash_is_one_line(tmp_path, monkeypatch, capsys, data_lost, kind):
    from distillery.cli.guard import run_guarded
    from distillery.cli.main import build_parser
    from distillery.tinybase.shipped import shipped_tiny_base

    base = tmp_path / "wan"
    shutil.copytree(shipped_tiny_base(), base)
    expected = _inject(base, kind)
    ws = tmp_path / "ws"
    ws.mkdir()
    monkeypatch.chdir(ws)
    (ws / "params.yaml").write_text(_params_with_base(base))
    for command in (["params", "check"], ["stage", "base", "--params", "params.yaml"]):
        ns = build_parser().parse_args(command)
        capsys.readouterr()
        rc = run_guarded(lambda: ns.func(ns))
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and expected in lines[0] and "Traceback" not in err, (command, err[-2000:])
    written = [p for p in (ws / "artifacts").rglob("*") if p.is_file()] if (ws / "artifacts").exists() else []
    data_lost.record(0, "files lost")
    assert written == [], written


def test_a_real_base_passes_the_file_checks(tiny_base):
    """The shipped tiny base and the one tests fit pass, with links to files (a Hugging Face snapshot's layout)."""
    from distillery.pipeline.publish.base_folder import REQUIRED
    from distillery.pipeline.publish.model_files import check_model_files
    from distillery.tinybase.shipped import shipped_tiny_base

    check_model_files(shipped_tiny_base(), "shipped", REQUIRED)
    check_model_files(tiny_base, "fitted", REQUIRED)
