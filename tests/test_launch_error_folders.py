"""The launcher's worker-error folders: one a killed launcher left behind is removed by the next launcher on the same
host, and nothing else in the temp folder is touched."""

from __future__ import annotations

import socket
from pathlib import Path

from distillery.cli.launch import ERRORS_PREFIX, error_folder_prefix, remove_orphaned_error_folders


def _dead_pid() -> int:
    """A pid no process can have: above the kernel's largest."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def test_only_a_dead_launchers_own_folder_is_removed(tmp_path: Path) -> None:
    dead = tmp_path / f"{error_folder_prefix(_dead_pid())}abc123"
    dead.mkdir()
    (dead / "rank-0.txt").write_text("a worker's line\n")
    (dead / "torch-logs" / "attempt_0").mkdir(parents=True)
    live = tmp_path / f"{error_folder_prefix()}def456"  # this process is alive: a running launcher's folder
    live.mkdir()
    host = socket.gethostname()
    elsewhere = [tmp_path / f"{ERRORS_PREFIX}{_dead_pid()}@other-{host}-gh7890",  # another host's launcher: alive or
                 tmp_path / f"{ERRORS_PREFIX}{_dead_pid()}@{host}-2-gh7890"]      # dead there, not here
    old_style = tmp_path / f"{ERRORS_PREFIX}k2j4h5_x"  # an earlier version's name carries no pid: whose it was is unknown
    for folder in (*elsewhere, old_style):
        folder.mkdir()
    a_file = tmp_path / f"{error_folder_prefix(_dead_pid())}file"
    a_file.write_text("not a folder")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    link = tmp_path / f"{error_folder_prefix(_dead_pid())}link"
    link.symlink_to(target, target_is_directory=True)

    assert remove_orphaned_error_folders(tmp_path) == [dead]
    assert not dead.exists()
    assert live.is_dir() and old_style.is_dir() and all(f.is_dir() for f in elsewhere)
    assert a_file.read_text() == "not a folder"
    assert link.is_symlink() and (target / "keep.txt").read_text() == "keep"


def test_an_unreadable_temp_folder_removes_nothing(tmp_path: Path) -> None:
    assert remove_orphaned_error_folders(tmp_path / "missing") == []
