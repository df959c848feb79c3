"""``--version`` on every program: the package version, plus the commit when run from a git checkout; never a
failure without one. The checkouts are made by the real ``git`` in a temporary directory."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import pytest

from vllm_etcd_proxy.fleet.version import CHECKOUT, git_commit

PROGRAMS = {"vllm-proxy": "proxy", "vllm-registrar": "registrar", "vllm-sim": "sim"}
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="the git command makes the checkouts")

Git = Callable[..., str]


def _git_in(directory: Path) -> Git:
    def git(*args: str) -> str:
        command = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-C", str(directory), *args]
        done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=30)
        return done.stdout.strip()

    return git


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, Git]:
    """A repository with two commits on branch main."""
    path = tmp_path / "repo"
    path.mkdir()
    git = _git_in(path)
    git("init", "-q", "-b", "main")
    for n in (1, 2):
        (path / "f").write_text(str(n))
        git("add", "f")
        git("commit", "-q", "-m", f"commit {n}")
    return path, git


def _expected_commit() -> str | None:
    """This checkout's commit as git itself says it (None outside a checkout)."""
    if not (CHECKOUT / ".git").exists():
        return None
    return _git_in(CHECKOUT)("rev-parse", "HEAD")[:7]


@needs_git
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_every_program_prints_the_package_version_and_the_checkouts_commit(program: str) -> None:
    module = f"vllm_etcd_proxy.{PROGRAMS[program]}"
    done = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    commit = _expected_commit()
    expected = f"{program} {metadata.version('vllm-etcd-proxy')}" + (f" (git {commit})" if commit else "")
    assert done.stdout == expected + "\n"


def test_version_needs_no_other_flag_and_ignores_the_environment() -> None:
    # The registrar would otherwise insist on --etcd, --role and --url.
    env = {"VLLM_REGISTRAR_VERSION": "x", "PATH": "/nonexistent"}  # and no git to ask
    done = subprocess.run(
        [sys.executable, "-m", "vllm_etcd_proxy.registrar", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("vllm-registrar ")


def test_no_git_checkout_gives_no_commit(tmp_path: Path) -> None:
    assert git_commit(tmp_path) is None


def test_an_unreadable_git_directory_gives_no_commit_and_no_error(tmp_path: Path) -> None:
    (tmp_path / ".git").write_text("not a gitdir line\n")
    assert git_commit(tmp_path) is None
    (tmp_path / ".git").unlink()
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_bytes(b"\xff\xfe")
    assert git_commit(tmp_path) is None


@needs_git
def test_a_branch_is_read_from_its_loose_ref_and_from_packed_refs(repo: tuple[Path, Git]) -> None:
    path, git = repo
    head = git("rev-parse", "HEAD")
    assert git_commit(path) == head[:7]
    git("pack-refs", "--all")
    assert not (path / ".git" / "refs" / "heads" / "main").exists()
    assert git_commit(path) == head[:7]


@needs_git
def test_a_detached_head_and_a_worktree_give_their_own_commits(repo: tuple[Path, Git], tmp_path: Path) -> None:
    path, git = repo
    first = git("rev-parse", "HEAD~1")
    git("worktree", "add", "-q", "-b", "older", str(tmp_path / "wt"), first)
    assert git_commit(tmp_path / "wt") == first[:7]
    git("checkout", "-q", "--detach", first)
    assert git_commit(path) == first[:7]


@needs_git
def test_a_repository_without_commits_gives_no_commit(tmp_path: Path) -> None:
    _git_in(tmp_path)("init", "-q")
    assert git_commit(tmp_path) is None
