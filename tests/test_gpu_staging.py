"""benchmarks/gpu/results_aside.sh: the committed results leave the working tree for the device calls and come back
whole, keeping the folders whose scripts the GPU calls run; it refuses to lose or overwrite anything."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu" / "results_aside.sh"


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "benchmarks" / "gpu").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "benchmarks" / "gpu" / SCRIPT.name)
    for folder in ("issue5-session25", "issue5-session30", "issue5-session40", "cpu-x"):
        d = repo / "benchmarks" / "results" / folder
        d.mkdir(parents=True)
        (d / "README.md").write_text(folder * 100)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    return repo


def _aside(repo: Path, what: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "benchmarks/gpu/results_aside.sh", what], cwd=repo, capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_results_go_aside_and_come_back_whole(tmp_path):
    repo = _repo(tmp_path)
    results = repo / "benchmarks" / "results"
    run = _aside(repo, "aside")
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in results.iterdir()) == ["issue5-session25", "issue5-session30"]
    assert sorted(p.name for p in (repo / ".gpu" / "aside").iterdir()) == ["cpu-x", "issue5-session40"]
    assert "2 result folders aside" in run.stdout
    assert _aside(repo, "aside").returncode != 0  # a second aside would mix two sets
    (results / "issue5-session47").mkdir()  # a session's new results, made while the others are aside
    run = _aside(repo, "back")
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in results.iterdir()) == ["cpu-x", "issue5-session25", "issue5-session30",
                                                          "issue5-session40", "issue5-session47"]
    assert (results / "cpu-x" / "README.md").read_text() == "cpu-x" * 100
    assert not (repo / ".gpu" / "aside").exists()
    assert _aside(repo, "back").returncode != 0  # nothing aside


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_back_refuses_to_overwrite_a_folder_of_the_same_name(tmp_path):
    repo = _repo(tmp_path)
    assert _aside(repo, "aside").returncode == 0
    (repo / "benchmarks" / "results" / "cpu-x").mkdir()
    run = _aside(repo, "back")
    assert run.returncode != 0 and "cpu-x exists" in run.stderr
    assert (repo / ".gpu" / "aside" / "cpu-x" / "README.md").exists()  # nothing moved
    assert _aside(repo, "nonsense").returncode == 2


@pytest.mark.skipif(shutil.which("pgrep") is None, reason="the script tells builds apart with pgrep")
def test_clear_build_locks_removes_a_stale_lock_and_leaves_a_running_builds(tmp_path):
    """benchmarks/gpu/clear_build_locks.sh (session 63: a killed megatron-core import left torch's extension-build
    lock, and every later import waited on it): a lock is removed when no build runs, kept while ``ninja`` runs."""
    script = ROOT / "benchmarks" / "gpu" / "clear_build_locks.sh"
    lock = tmp_path / "py312_cu130" / "managed_alloc_runtime" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    done = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0 and not lock.exists() and "removed stale" in done.stderr
    lock.touch()
    ninja = tmp_path / "ninja"  # a process named ninja: pgrep -x matches the executable's name
    shutil.copy(shutil.which("sleep"), ninja)
    builder = subprocess.Popen([str(ninja), "30"])
    try:
        kept = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True)
    finally:
        builder.kill()
        builder.wait()
    assert kept.returncode == 0 and lock.exists() and "left alone" in kept.stderr
    assert subprocess.run(["bash", str(script), str(tmp_path / "absent")]).returncode == 0
