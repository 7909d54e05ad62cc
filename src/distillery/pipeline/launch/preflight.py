"""Before a stage works: can it write its outputs, is there room for them, and can it hold what it
computes?

:func:`check_writable` probes each output folder with a real file (root ignores permission bits, so
only a write shows a read-only mount); :func:`check_free_space` compares the free bytes of the file
system with a lower-bound estimate of what the stage writes (:func:`estimate_bytes`), so a full disk
is found before the work, not after it. Both raise a one-line :class:`UserError`. :func:`disk_error`
turns the OSError of a write that failed anyway (ENOSPC, EROFS, ...) into one. :func:`check_memory`
compares the largest buffers the params make a stage allocate (one clip, one batch of latents) with
the machine's memory, from the params alone, before anything is touched: a batch no machine here can
hold is one line, not a training run that dies after ``runs/<stage>`` was reset; :func:`check_batch`
does the same for a global batch larger than the latent set. :func:`check_paths` checks every folder
and file ``params.yaml`` names (``base.path``, ``latents.data``) the way the stage that reads it
will, when the file is validated: by every stage up to that one (a ``base.path`` that is not a model
folder stops ``clips`` before it works, not ``base`` after ``clips`` ran; a ``validate.clip_model``
that is not a CLIP folder, or a ``validate.vbench.models`` folder missing, stops the first stage, not ``validate``
after training) and by
``distillery params check``.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from pathlib import Path

from distillery.common.errors import UserError
from distillery.common.fsutil import file_kind, read_json_file
from distillery.common.fsutil import human_bytes as human
from distillery.pipeline.params.reader import Params
from distillery.pipeline.params.schema import CLIPS_VIDEOS, DATA_ARTIFACT, SHIPPED_TINY_BASE, TRAINING_STAGES, given_path

DISK_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EFBIG: "a file grew past the file system's (or the process's) size limit",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}
MIN_FREE = 16 << 20  # bytes every stage needs at least (logs, manifests, MLflow rows)


MAX_SQLITE_PATH = 500  # bytes of the MLflow store's path SQLite still opens (its journal's name must fit 512)


def check_workspace_path(stage: str) -> None:
    """The workspace's MLflow store (``mlflow.db`` in the current folder, unless
    ``MLFLOW_TRACKING_URI`` names another) must have a path SQLite can open: a workspace nested ~500
    bytes deep failed every stage after its work, when the store was first opened. One line, exit 2,
    before anything runs."""
    from distillery.components.tracking import default_tracking_uri
    from distillery.config.schema import TrackerConfig

    uri = default_tracking_uri(TrackerConfig())  # the store every stage and trainer of this workspace opens
    if not uri.startswith("sqlite:///"):
        return
    size = len(os.fsencode(uri[len("sqlite:///"):]))
    if size > MAX_SQLITE_PATH:
        raise UserError(f"stage {stage}: the MLflow store's path ({uri[len('sqlite:///'):][:48]}…) is {size} bytes long; "
                        f"SQLite opens at most {MAX_SQLITE_PATH}: move the workspace to a shorter path (or set "
                        "MLFLOW_TRACKING_URI to a store elsewhere); nothing was changed")
    db = Path(uri[len("sqlite:///"):])
    try:
        fd = os.open(db, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # made on first use
    except OSError as exc:
        raise UserError(f"stage {stage}: the MLflow store {db} cannot be opened ({exc.strerror or exc}); nothing was changed") from None
    try:
        st = os.fstat(fd)
        head = os.read(fd, 16) if stat.S_ISREG(st.st_mode) else b""
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"stage {stage}: the MLflow store {db} is {file_kind(st.st_mode)}, not a database file: move it "
                        "away (or set MLFLOW_TRACKING_URI to another store); nothing was changed")
    if st.st_size and head != b"SQLite format 3\x00":
        raise UserError(f"stage {stage}: the MLflow store {db} is not an SQLite database (its first bytes are not "
                        "SQLite's): move it away (a new one is made) or set MLFLOW_TRACKING_URI; nothing was changed")


def check_own_folders(stage: str, artifacts: Path, runs: Path, training: bool) -> None:
    """The folders the stage writes into and may clean up — ``artifacts/<stage>``, its staging folder
    ``artifacts/<stage>.tmp``, ``runs/.locks`` and, for a training stage, ``runs/<stage>`` — must
    each be a real folder or absent: a symbolic link there (or a file) is one line, exit 2, before
    anything is written or deleted, and neither the link nor what it points at is touched
    (docs/reliability.md)."""
    from distillery.common.ownpaths import require_folder_or_absent

    places = [(artifacts / stage, "the artifact folder"), (artifacts / f"{stage}.tmp", "the staging folder"),
              (runs / ".locks", "the lock folder")]
    if training:
        places.append((runs / stage, "the run folder"))
    for path, what in places:
        require_folder_or_absent(path, f"stage {stage}: {what}")


def check_writable(folders: list[Path], stage: str) -> None:
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=folder)
            try:
                os.write(fd, b"x")
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError as exc:
            why = DISK_ERRNOS.get(exc.errno or 0, exc.strerror or type(exc).__name__)
            raise UserError(f"stage {stage}: cannot write to {folder.resolve()}: {why}; nothing was changed") from None


def _tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _transformer_bytes(model: Path) -> int:
    folder = model / "transformer" if (model / "transformer").is_dir() else model
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def estimate_bytes(stage: str, params: Params, artifacts: Path) -> int:
    """A lower bound of the bytes ``stage`` writes (its artifact, and checkpoints for training)."""
    if stage == "clips":
        c = params.get("clips")
        frames = (c.num_train + c.num_validation) * c.num_frames * c.size ** 2 * 3
        return frames // 100  # encoded video of synthetic shapes compresses by far more than 100x
    if stage == "base":
        from distillery.pipeline.params.base_path import resolve_base

        return _tree_bytes(resolve_base(params.get("base.path")))
    if stage == "latents":
        c = params.get("clips")
        data = given_path(params.get("latents.data"), CLIPS_VIDEOS)
        count = c.num_train + c.num_validation if not data else sum(1 for _ in Path(data).rglob("*") if _.is_file()) // 2
        latent = 16 * ((c.num_frames - 1) // 4 + 1) * (c.size // 8) ** 2 * 4
        return count * latent
    if stage in TRAINING_STAGES:
        return sum(training_bytes(stage, params, artifacts))
    if stage == "export":
        student = params.get("export.student")
        return _tree_bytes(artifacts / "base" / "model") + _transformer_bytes(artifacts / str(student) / "model")
    return 0


def training_bytes(stage: str, params: Params, artifacts: Path, runs: Path | None = None) -> tuple[int, int]:
    """Lower bounds of what training stage ``stage`` writes: ``(artifact, checkpoints)`` bytes — the
    exported model, and in ``runs/`` its checkpoints (one checkpoint when the run writes only its
    final one, ``save_every`` 0 or ≥ ``steps``; else a new one beside the previous) and, for
    ``pretrain.method: ode_init*``, the teacher's trajectory set (:func:`trajectory_bytes`)."""
    section = params.get(stage)
    if section.off():  # switched off (posttrain.enabled: false): an off record, nothing trained
        return 0, 0
    student = params.recipe(stage).inputs(section)["student"]  # the role the artifact ships
    weights = _transformer_bytes(artifacts / student / "model")
    fp32 = weights * 2 if weights else 0  # lower bound: the init may be bf16; the master weights are fp32
    checkpoint = 3 * fp32  # weights + AdamW's two moments (of the exported role alone: a lower bound)
    every, steps = params.get(f"{stage}.save_every"), params.get(f"{stage}.steps")
    return fp32, checkpoint * (1 if every == 0 or every >= steps else 2) + trajectory_bytes(stage, params, artifacts, runs)


def trajectory_bytes(stage: str, params: Params, artifacts: Path, runs: Path | None = None) -> int:
    """A lower bound of the trajectory set ``pretrain.method: ode_init*`` writes in
    ``runs/<stage>_trajectories`` (published into the artifact by hard link: counted once): float32,
    per training prompt and seed, one latent of ``len(t_list)`` points stacked along the channels
    (``t_list``'s last point is the clean end); less what an earlier, killed run already wrote
    there. 0 for any other stage or method, or when the prompt count cannot be told here."""
    if stage != "pretrain" or getattr(params.recipe(stage), "prepare", None) is None:  # trains on the stage's data
        return 0
    found = prompt_rows(params, artifacts) if params.get("pretrain.data") == "prompts" else training_rows(params, artifacts)
    if not found:
        return 0
    c, t, h, w = latent_shape(params)
    total = found[0] * int(params.get("pretrain.seeds_per_prompt")) * len(params.get("pretrain.t_list")) * c * t * h * w * 4
    done = _tree_bytes(runs / f"{stage}_trajectories") if runs is not None else 0
    return max(0, total - done)


def clip_size(params: Params) -> tuple[int, int, int]:
    """``(frames, height, width)`` of the clips the latents stage encodes (``latents.*``, else
    ``clips.*``)."""
    frames = params.get("latents.num_frames") or params.get("clips.num_frames")
    return frames, params.get("latents.height") or params.get("clips.size"), params.get("latents.width") or params.get("clips.size")


def latent_shape(params: Params) -> tuple[int, int, int, int]:
    """``(C, T, H, W)`` of one latent clip as the params make it: the base's VAE geometry
    (``base.path``'s folder, read through the family registry:
    :func:`distillery.models.registry.vae_geometry`) over the clips' frames and size."""
    from distillery.models.registry import latent_shape_for
    from distillery.pipeline.params.base_path import resolve_base

    frames, height, width = clip_size(params)
    c, t, h, w = latent_shape_for(resolve_base(params.get("base.path")), frames, height, width, "params.yaml")
    return c, t, h, w


def memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def largest_buffer(stage: str, params: Params) -> tuple[int, str] | None:
    """A lower bound of the largest buffer ``stage`` allocates, from the params alone, and what it is
    (the knobs that size it named as in params.yaml); None for a stage without one."""
    if stage == "clips":
        c = params.get("clips")
        return c.num_frames * c.size ** 2 * 3, f"one clip of clips.num_frames {c.num_frames} frames of " \
                                               f"clips.size {c.size}² RGB pixels"
    if stage == "latents":
        frames, height, width = clip_size(params)
        return frames * height * width * 3 * 4, f"one clip of {frames}×{height}×{width} float32 RGB frames for the VAE " \
                                                  "(latents.num_frames, height, width)"
    if stage in TRAINING_STAGES and not params.get(stage).off():
        batch, ranks = params.get(f"{stage}.batch_size"), params.get("gpus.nproc_per_node")
        shape = latent_shape(params)
        count = batch * ranks * shape[0] * shape[1] * shape[2] * shape[3]
        return count * 4, (f"one batch ({stage}.batch_size {batch} × gpus.nproc_per_node {ranks}) of latents "
                           f"{'×'.join(map(str, shape))} in float32 (latents.num_frames, height, width)")
    return None


def check_memory(stage: str, params: Params) -> None:
    """Refuse, before any work, a stage whose params make it allocate more than the machine's memory.
    """
    found = largest_buffer(stage, params)
    if found is None:
        return
    need, what = found
    have = memory_bytes()
    if need > have:
        raise UserError(f"stage {stage}: {what} needs {human(need)} of memory, more than this machine's {human(have)}; "
                        "lower those params; nothing was changed")


def training_rows(params: Params, artifacts: Path, encoded: bool = True) -> tuple[int, str] | None:
    """How many training samples the training stages will have, and from where, read without encoding
    anything: with ``encoded``, the latent set's manifest when ``artifacts/latents`` exists (a
    training stage trains on what was encoded); else — and always before the latents are (re)made —
    the captions lines of ``latents.data``'s train split (an upper bound: an unusable video is
    skipped later), or ``clips.num_train`` (the synthetic clips). None when it cannot be told here
    (the stage that reads the data names the problem)."""
    if encoded:
        try:
            manifest = read_json_file(artifacts / DATA_ARTIFACT / "data" / "preprocess.json", 64 << 20)  # never blocks on a FIFO
            return int(manifest["splits"]["train"]["rows"]), "artifacts/latents"
        except (OSError, ValueError, KeyError, TypeError):
            pass
    data = given_path(params.get("latents.data"), CLIPS_VIDEOS)
    if not data:
        return params.get("clips.num_train"), "clips.num_train"
    from distillery.data.video_folder import find_captions_file, find_splits

    try:
        lines = nonblank_lines(find_captions_file(find_splits(Path(data))["train"]))
    except (OSError, UserError):
        return None
    return None if lines is None else (lines, f"the {lines} captions of {data}")


def nonblank_lines(path: str | Path, refuse_nul: bool = False) -> int | None:
    """The non-blank lines of ``path``, read only if it is a regular file (opened non-blocking: a FIFO
    never blocks the check); None when it cannot be read, is not a regular file, or (``refuse_nul``)
    holds a NUL byte."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            lines = 0
            with os.fdopen(os.dup(fd), "rb") as fh:
                for line in fh:
                    if refuse_nul and b"\0" in line:
                        return None
                    lines += 1 if line.strip() else 0
        finally:
            os.close(fd)
    except (OSError, TypeError):
        return None
    return lines


def prompt_rows(params: Params, artifacts: Path, encoded: bool = True) -> tuple[int, str] | None:
    """How many prompts a stage with ``<stage>.data: prompts`` trains on: with ``encoded``, the prompt
    set's manifest when ``artifacts/prompts`` exists; else the non-blank lines of ``prompts.path``
    (a regular file, never opened blocking). None when it cannot be told here — no such file, no
    line, a NUL byte: the prompts stage names the problem in its own line."""
    if encoded:
        try:
            manifest = read_json_file(artifacts / "prompts" / "data" / "preprocess.json", 64 << 20)
            return int(manifest["splits"]["train"]["rows"]), "artifacts/prompts"
        except (OSError, ValueError, KeyError, TypeError):
            pass
    path = params.get("prompts.path")
    lines = nonblank_lines(path, refuse_nul=True)
    return (lines, f"the {lines} prompts of {path}") if lines else None


def check_batch(stage: str, params: Params, artifacts: Path, stages: tuple[str, ...] | None = None,
                label: str | None = None) -> None:
    """Refuse, before any work, a training stage whose global batch is larger than its training samples
    (:func:`training_rows`; the trainer would refuse it only after the latents were encoded and
    ``runs/<stage>`` reset). ``stages``: the training stages to check (default: ``stage`` alone when
    it is one) — the first stage of a DAG checks every one that is on, so a small folder of one's own videos
    stops before anything is encoded, with one line naming every key to lower."""
    names = [n for n in (stages if stages is not None else (stage,)) if n in TRAINING_STAGES and not params.get(n).off()]
    if not names:
        return
    encoded = stage in TRAINING_STAGES  # before them: the data to be encoded
    kinds = {n: params.get(n).data_artifact() for n in names}
    for kind in dict.fromkeys(kinds.values()):  # the latent set's stages, then the prompt set's (<stage>.data: prompts)
        found = prompt_rows(params, artifacts, encoded) if kind == "prompts" else training_rows(params, artifacts, encoded)
        if found is not None:
            _check_batch_rows([n for n in names if kinds[n] == kind], found, stage, params, label)


def _check_batch_rows(names: list[str], found: tuple[int, str], stage: str, params: Params, label: str | None) -> None:
    rows, source = found
    gpus = params.get("gpus")
    ranks, nodes = gpus.nproc_per_node, gpus.nnodes

    def data_ranks(name: str) -> int:  # the ranks that draw their own samples: an SP or TP group shares one
        layout = params.get(name).layout(gpus)
        return max(1, gpus.world_size // (layout["sp_size"] * layout["tp_size"]))

    over = [(n, params.get(f"{n}.batch_size"), data_ranks(n)) for n in names
            if params.get(f"{n}.batch_size") * data_ranks(n) > rows]
    if over:
        keys = ", ".join(f"{n}.batch_size {b}" for n, b, _ in over)
        groups = "" if all(d == gpus.world_size for _, _, d in over) else " / the SP × TP group"
        fix = " ".join(f"-S {n}.batch_size={max(1, rows // d)}" for n, _, d in over)
        raise UserError(f"{label or f'stage {stage}'}: one global batch (× gpus.nproc_per_node {ranks} × gpus.nnodes {nodes}"
                        f"{groups}) of {keys} is more than the {rows} training samples ({source}); lower it (dvc exp run "
                        f"{fix}, or docs/profiles/few-videos.yaml) or use more data; nothing was changed")


def _check_base_path(params: Params) -> None:
    """``base.path``: the shipped tiny Wan or a diffusers folder of a registered family the base stage accepts: a
    ``model_index.json`` of library classes only
    (:func:`~distillery.pipeline.publish.base_folder.check_model_index`, the base stage's own check)
    and a transformer config. Only that module is imported: the stages before ``base`` keep their
    code deps small."""
    path = params.get("base.path")
    if given_path(path, SHIPPED_TINY_BASE) is None:
        return
    from distillery.pipeline.publish.base_folder import check_model_index  # only for a folder: the tiny default's stages never import it
    source = Path(path).expanduser()
    if not (source / "model_index.json").is_file():
        raise UserError(f"params.yaml: base.path: {source} is not a diffusers model folder (no model_index.json); use "
                        "'tiny' or a Wan2.1 folder")
    check_model_index(source, f"params.yaml: base.path: {source}")
    if not (source / "transformer" / "config.json").is_file():
        raise UserError(f"params.yaml: base.path: {source} has no transformer/config.json: not a video model folder; "
                        f"use {SHIPPED_TINY_BASE} (the shipped tiny Wan) or a diffusers Wan, Cosmos Predict 2.5 or "
                        "HunyuanVideo 1.5 folder")


CAPTION_FILES = ("captions.jsonl", "videos2caption.json")  # distillery.data.video_folder.CAPTION_FILES (a test keeps them equal)


def _check_latents_data(params: Params) -> None:
    """``latents.data`` (when one's own: not the clips stage's): a folder with a captions file, or
    ``train/`` [+ ``validation/``] split folders each with one, as the latents stage reads it
    (:func:`distillery.data.video_folder.find_splits` checks the files themselves; this is the
    folder layout, without importing the data package)."""
    data = given_path(params.get("latents.data"), CLIPS_VIDEOS)
    if not data:
        return
    folder = Path(data).expanduser()
    if not folder.is_dir():
        raise UserError(f"params.yaml: latents.data: {folder} does not exist or is not a folder; name a folder of "
                        f"videos/ + {CAPTION_FILES[0]}")
    splits = [folder / "train", folder / "validation"] if (folder / "train").is_dir() else [folder]
    if (folder / "validation").is_dir() and not (folder / "train").is_dir():
        raise UserError(f"params.yaml: latents.data: {folder} has a validation/ split but no train/ split")
    for split in splits:
        if split.is_dir() and not any((split / name).exists() for name in CAPTION_FILES):
            raise UserError(f"params.yaml: latents.data: no captions file in {split}: expected {CAPTION_FILES[0]} "
                            f'(lines of {{"path": "videos/x.mp4", "caption": "..."}}) or {CAPTION_FILES[1]}')


def _check_clip_model(params: Params) -> None:
    """``validate.clip_model`` (when set): a CLIP folder the validate stage loads
    (:func:`distillery.evaluation.clip_scores.check_clip_folder`, its own check: reads only
    config.json)."""
    folder = params.get("validate.clip_model")
    if folder:
        from distillery.evaluation.clip_scores import check_clip_folder  # only when set: the default's stages never import it

        check_clip_folder(folder, "params.yaml: validate.clip_model")


def _check_vbench_models(params: Params) -> None:
    """``validate.vbench.models`` (when ``validate.vbench.dimensions`` is set): the folder of every model the chosen
    dimensions read, given and holding its file (:func:`distillery.evaluation.vbench.models.check_folders`: reads no
    weights)."""
    vbench = params.get("validate.vbench")
    if vbench.dimensions:
        from distillery.evaluation.vbench.models import check_folders  # only when set: the default's stages never import it

        check_folders(vbench.models.given(), vbench.dimensions, "params.yaml: validate.vbench.models")


# params.yaml keys naming a path -> (the first stage that reads it, its check)
PATH_PARAMS = {"base.path": ("base", _check_base_path), "latents.data": ("latents", _check_latents_data),
               "validate.clip_model": ("validate", _check_clip_model),
               "validate.vbench.models": ("validate", _check_vbench_models)}


def check_paths(params: Params, stage: str | None = None, order: tuple[str, ...] = ()) -> None:
    """Refuse (one line) a path ``params.yaml`` names that the stage reading it would refuse — before
    any work. ``stage``: the stage about to run; it checks the paths of itself and of every stage
    after it in ``order`` (the DAG order of the stage table,
    :data:`distillery.pipeline.launch.runner.STAGES`; a stage that ran already is not asked again);
    None: all of them."""
    order = tuple(order)
    at = order.index(stage) if stage in order else 0
    for reader, check in PATH_PARAMS.values():
        if stage is None or reader not in order or order.index(reader) >= at:
            check(params)


#: The stages that check the recipes against the base's model family: the base stage (it reads the base folder; before
#: the latents are encoded) and the training stages (they build the models); the stages before the base's import none
#: of the model registry (their code deps stay free of it).
FAMILY_CHECKING_STAGES = ("base", *TRAINING_STAGES)


def check_recipe_families(params: Params, stage: str | None = None, order: tuple[str, ...] = ()) -> None:
    """Refuse (one line) a training stage's recipe that ``base.path``'s model family builds no student for — a
    HunyuanVideo 1.5 base with a causal recipe (``pretrain.method: dfsft``, ``distill.method: self_forcing``) — before
    its work: ``stage`` (one of :data:`FAMILY_CHECKING_STAGES`; another checks nothing) checks every training stage at
    or after it in ``order`` that trains (not given, not off), as :func:`check_paths` does (None: all of them, as
    ``distillery params check`` does). The family is read from the base folder
    (:func:`distillery.models.registry.family_of`: its transformer's class and layout; the table imports no family);
    the kind a recipe trains is its module's (:func:`~distillery.pipeline.params.recipes.student_kind`)."""
    if stage is not None and stage not in FAMILY_CHECKING_STAGES:
        return
    order = tuple(order)
    at = order.index(stage) if stage in order else 0
    later = [n for n in TRAINING_STAGES if stage is None or n not in order or order.index(n) >= at]
    running = [n for n in later if not params.get(n).given() and not params.get(n).off()]
    if not running:
        return
    from distillery.models.registry import family_of
    from distillery.pipeline.params.base_path import resolve_base
    from distillery.pipeline.params.recipes import student_kind

    base = resolve_base(params.get("base.path"))
    family = family_of(base)
    for name in running:
        kind = student_kind(params.recipe(name))
        why = family.refusal(kind)
        if why is not None:
            raise UserError(f"params.yaml: {name}.method: {params.get(name).method} trains a {kind} student; base.path is a "
                            f"{family.name} model ({base}): {why}; nothing was run")


def check_free_space(stage: str, params: Params, artifacts: Path, runs: Path | None = None) -> None:
    """Refuse a stage whose writes (:func:`estimate_bytes`) do not fit: a training stage's checkpoints
    are counted on the file system of ``runs`` (which may be another disk: a symlink to scratch
    space), its exported model on that of ``artifacts``."""
    if stage in TRAINING_STAGES and runs is not None:
        artifact, checkpoints = training_bytes(stage, params, artifacts, runs)
        needs = [(artifacts, artifact), (runs, checkpoints)]
    else:
        needs = [(artifacts, estimate_bytes(stage, params, artifacts))]
    places: dict[int, Path] = {}  # file system (st_dev) -> the first folder on it
    totals: dict[int, int] = {}
    for path, need in needs:
        where = _existing(path)
        dev = os.stat(where).st_dev
        places.setdefault(dev, where)
        totals[dev] = totals.get(dev, 0) + need
    for dev, where in places.items():
        need = totals[dev] + MIN_FREE
        free = shutil.disk_usage(where).free
        if free < need:
            raise UserError(f"stage {stage}: needs at least {human(need)} free in {where.resolve()}, only {human(free)} "
                            f"left; free some space (or move the workspace) and rerun; nothing was changed")


def _existing(path: Path) -> Path:
    """``path``, or its nearest existing parent (``runs/`` before the first training stage made it).
    """
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_error(stage: str, exc: BaseException) -> UserError | None:
    """A one-line UserError for a write that failed on the disk's account — also one a library wrapped
    (:func:`distillery.common.diskerrors.disk_problem`: DCP, copytree, safetensors, SQLite) — else
    None."""
    from distillery.common.diskerrors import DiskProblem, disk_problem

    problem = disk_problem(exc)
    if problem is None and isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM):
        problem = DiskProblem(DISK_ERRNOS[exc.errno], exc.errno, str(exc.filename) if exc.filename else None)
    if problem is None:
        return None
    return UserError(f"stage {stage}: {problem.why}{problem.where()}; its partial output was removed and the previous "
                     f"artifacts/{stage} is unchanged; fix the disk and rerun")
