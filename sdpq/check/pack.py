"""`sdpq check pack`: build what the GPU machine lacks into one ignored folder and print the
exact command to run there.

The GPU machine has no network and its own Python (3.12, torch 2.11, Triton, transformers,
...) but no DeepSpeed. DeepSpeed is an sdist whose build imports torch, so it is built here
into a pure-Python wheel (`DS_BUILD_OPS=0`: no compiled ops; sdpq needs none) and carried with
the few packages it needs that the machine's image does not hold (pydantic and hjson).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["add_arguments", "main", "device_command", "git_commit", "tree_digest", "CARRY_DIR"]

CARRY_DIR = ".carry"
# Needed by DeepSpeed and absent from the GPU image (its package list has the rest: einops,
# msgpack, ninja, numpy, packaging, psutil, py-cpuinfo, tqdm, nvidia-ml-py).
BINARY_DEPS = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "hjson")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
DEVICE_TIMEOUT_S = 420  # the check's 360 s budget + start-up; a second run still fits in 15 minutes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dest", default=CARRY_DIR, help="folder to fill (git-ignored)")
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python (binary wheels are per version)")
    p.add_argument("--no-deepspeed", action="store_true", help="carry nothing for the ZeRO-3 step")


def git_commit(root: Path) -> str | None:
    """The checkout's short HEAD, "+local changes" when tracked files differ; None without git."""
    try:
        run = functools.partial(subprocess.run, cwd=root, capture_output=True, text=True, check=True, timeout=20)
        head = run(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
        dirty = run(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+local changes" if dirty else head


def tree_digest(root: Path) -> str:
    """sha256 of the package's sources (sdpq/: .py, .h, .cpp), to tell whether a copied tree is
    the one `sdpq check pack` saw."""
    h = hashlib.sha256()
    for path in sorted(p for p in (root / "sdpq").rglob("*") if p.suffix in (".py", ".h", ".cpp")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _installed_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _pip(*args: str, env: dict | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def device_command(dest: str = CARRY_DIR, rehearse: bool = False) -> str:
    """The one command for the GPU machine (run from the repository root, `dest` carried)."""
    install = (
        f"if ls {dest}/wheels/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps "
        f"--no-compile --no-cache-dir --upgrade --target /tmp/site {dest}/wheels/*.whl "
        "&& export PYTHONPATH=/tmp/site; fi; "
    )
    return install + f'./run gpu-check --out "${{OUT:-runs/gpu_check}}"{" --rehearse" if rehearse else ""}'


def main(args: argparse.Namespace) -> int:
    dest = Path(args.dest)
    wheels = dest / "wheels"
    if wheels.exists():
        shutil.rmtree(wheels)
    wheels.mkdir(parents=True)
    pins = {}
    if not args.no_deepspeed:
        ds = _installed_version("deepspeed")
        env = dict(os.environ, DS_BUILD_OPS="0")
        # --no-build-isolation: DeepSpeed's setup.py imports torch; an isolated build would
        # fetch a CUDA torch (GBs). It builds against the torch installed here; the wheel is
        # pure Python and works with the GPU machine's torch.
        _pip("wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(wheels), f"deepspeed=={ds}", env=env)
        for name in BINARY_DEPS:
            pins[name] = _installed_version(name)
        plat = [a for p in PLATFORMS for a in ("--platform", p)]
        _pip(
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            args.python_version,
            "--implementation",
            "cp",
            *plat,
            "-d",
            str(wheels),
            *[f"{n}=={v}" for n, v in pins.items()],
        )
        pins["deepspeed"] = ds
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    (dest / "manifest.json").write_text(
        json.dumps(
            {
                "python": args.python_version,
                "pins": pins,
                "bytes": size,
                "commit": git_commit(Path.cwd()),
                "tree_sha256": tree_digest(Path.cwd()),
            },
            indent=1,
        )
    )
    print(f"\npacked {dest}/ ({size / 2**20:.1f} MiB): {', '.join(sorted(p.name for p in wheels.iterdir()))}")
    print("\nOn the GPU machine (device tool `run`), from the repository root:")
    print(
        json.dumps(
            {"carry": [str(dest)], "timeout_s": DEVICE_TIMEOUT_S, "command": device_command(str(dest))}, indent=1
        )
    )
    print(f"\nThe same on a CPU machine (rehearsal): {device_command(str(dest), rehearse=True)}")
    return 0
