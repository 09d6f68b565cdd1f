"""sdpq.check.runner's provenance: which commit a GPU report names."""

import json
import subprocess

from sdpq.check import pack, runner


def _tree(tmp_path, git: bool):
    (tmp_path / "sdpq").mkdir()
    (tmp_path / "sdpq" / "a.py").write_text("x = 1\n")
    if git:
        run = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)  # noqa: E731
        run("init", "-q")
        run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "stale")
    return tmp_path


def _manifest(root, commit: str, digest: str) -> None:
    (root / pack.CARRY_DIR).mkdir()
    (root / pack.CARRY_DIR / "manifest.json").write_text(json.dumps({"commit": commit, "tree_sha256": digest}))


def test_a_manifest_of_these_sources_names_the_commit_before_a_stale_git(tmp_path, monkeypatch):
    root = _tree(tmp_path, git=True)
    _manifest(root, "abc1234", pack.tree_digest(root))
    monkeypatch.chdir(root)
    meta = runner._provenance([])
    assert meta["commit"] == "abc1234 (as packed)" and meta["tree_sha256"] == pack.tree_digest(root)


def test_a_manifest_of_other_sources_is_named_only_without_git(tmp_path, monkeypatch):
    root = _tree(tmp_path, git=False)
    _manifest(root, "abc1234", "0" * 64)
    monkeypatch.chdir(root)
    assert runner._provenance([])["commit"] == "abc1234 (as packed; sdpq/ changed since)"
