"""``--version`` for every program: the installed package's version, and the git commit of a checkout.

    vllm-proxy 0.1.0 (git 7144fd8)

The commit is read from the checkout's ``.git`` (``HEAD``, then the loose ref or ``packed-refs``; a worktree's
``.git`` file points to its own directory), with no ``git`` process in the common case. Only a layout we cannot
read (reftable, say) asks ``git rev-parse``. Anything else, a wheel in site-packages, no ``git`` installed, a
broken ``.git``, prints the version alone: ``--version`` never fails.
"""

from __future__ import annotations

import argparse
import subprocess
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

DISTRIBUTION = "vllm-etcd-proxy"
CHECKOUT = Path(__file__).resolve().parent.parent
"""Where a checkout would hold ``.git``: fleet/ sits at the repository's top (vllm_etcd_proxy/ only links it)."""
SHORT = 7
"""Hex digits of the commit shown, as ``git log --oneline`` shows them."""
GIT_TIMEOUT = 2.0
"""Seconds ``git rev-parse`` may take before the commit is left out."""


def package_version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"  # run from a tree that was never installed


def git_commit(checkout: Path = CHECKOUT) -> str | None:
    """The short commit ``checkout`` has checked out, or None when it is no git checkout (or cannot be read)."""
    dot_git = checkout / ".git"
    if not dot_git.exists():
        return None
    try:
        commit = _read_head(dot_git)
    except (OSError, UnicodeDecodeError):
        commit = None
    if commit is None:
        commit = _ask_git(checkout)
    return commit[:SHORT] if commit else None


def _read_head(dot_git: Path) -> str | None:
    git_dir = dot_git
    if dot_git.is_file():  # a worktree (or submodule): "gitdir: PATH"
        text = dot_git.read_text().strip()
        if not text.startswith("gitdir:"):
            return None
        git_dir = (dot_git.parent / text.removeprefix("gitdir:").strip()).resolve()
    head = (git_dir / "HEAD").read_text().strip()
    if not head.startswith("ref:"):
        return head if _is_commit(head) else None  # detached
    ref = head.removeprefix("ref:").strip()
    # A worktree's branches live in the main repository's directory, which "commondir" names.
    common = git_dir / "commondir"
    common_dir = (git_dir / common.read_text().strip()).resolve() if common.is_file() else git_dir
    for directory in dict.fromkeys((git_dir, common_dir)):
        loose = directory / ref
        if loose.is_file():
            commit = loose.read_text().strip()
            return commit if _is_commit(commit) else None
    return _packed_ref(common_dir / "packed-refs", ref)


def _packed_ref(packed: Path, ref: str) -> str | None:
    if not packed.is_file():
        return None
    for line in packed.read_text().splitlines():
        commit, _, name = line.partition(" ")
        if name == ref and _is_commit(commit):
            return commit
    return None


def _is_commit(text: str) -> bool:
    return len(text) in (40, 64) and all(c in "0123456789abcdef" for c in text)


def _ask_git(checkout: Path) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(checkout), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and _is_commit(commit) else None


def describe(program: str) -> str:
    """What ``program --version`` prints: ``vllm-proxy 0.1.0 (git 7144fd8)``, or without the commit."""
    commit = git_commit()
    return f"{program} {package_version()}" + (f" (git {commit})" if commit else "")


class _VersionAction(argparse.Action):
    """argparse's own version action, with the text worked out only when the flag is given."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(describe(parser.prog))
        parser.exit()


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` a ``--version`` that prints :func:`describe` for its program and exits 0."""
    parser.add_argument(
        "--version", action=_VersionAction, help="print the version (and the git commit of a checkout) and exit"
    )
