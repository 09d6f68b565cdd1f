"""Real text on every machine: the Python standard library's source, as bytes.

The corpus is the sorted ``*.py`` files of the running interpreter's stdlib, concatenated and
cached as a uint8 file on first use (``~/.cache/sdpq`` unless ``SDPQ_CACHE`` says otherwise).
Batches are a pure function of (seed, step, rank): every rank and every resumed run draws the
same tokens without any data-loader state to checkpoint. A directory of text files or a
Megatron-style ``.bin``/``.idx`` pair can be used instead (``TokenData.from_path``).
"""

from __future__ import annotations

import hashlib
import os
import struct
import sysconfig
from pathlib import Path

import numpy as np
import torch

__all__ = ["TokenData", "stdlib_corpus"]


def _cache_dir() -> Path:
    d = Path(os.environ.get("SDPQ_CACHE", Path.home() / ".cache" / "sdpq"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def stdlib_corpus(max_bytes: int = 16 << 20) -> Path:
    """Path of the cached uint8 corpus (built once; atomic rename so parallel ranks are safe)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    key = hashlib.sha1(f"{root}:{max_bytes}".encode()).hexdigest()[:12]
    out = _cache_dir() / f"stdlib-{key}.u8"
    if out.exists():
        return out
    chunks, total = [], 0
    for f in sorted(root.rglob("*.py")):
        if "site-packages" in f.parts or "test" in f.parts or "tests" in f.parts:
            continue  # tests hold generated and binary-ish data; keep prose-like code
        data = f.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(b"".join(chunks)[:max_bytes])
    tmp.replace(out)
    return out


def _read_megatron(prefix: Path) -> np.ndarray:
    """Token ids of a Megatron-LM indexed dataset (``.idx`` header + ``.bin`` tokens), flattened."""
    with open(prefix.with_suffix(".idx"), "rb") as f:
        if f.read(9) != b"MMIDIDX\x00\x00":
            raise ValueError(f"{prefix}.idx: not a Megatron indexed dataset (bad magic)")
        (_version,) = struct.unpack("<Q", f.read(8))
        (code,) = struct.unpack("<B", f.read(1))
    dtypes = {
        1: np.uint8,
        2: np.int8,
        3: np.int16,
        4: np.int32,
        5: np.int64,
        6: np.float64,
        7: np.float32,
        8: np.uint16,
    }
    if code not in dtypes:
        raise ValueError(f"{prefix}.idx: unknown dtype code {code}")
    return np.memmap(prefix.with_suffix(".bin"), dtype=dtypes[code], mode="r")


class TokenData:
    """A flat token array split into train (first 95%) and validation (last 5%)."""

    def __init__(self, tokens: np.ndarray, vocab_size: int = 256) -> None:
        if tokens.size < 10_000:
            raise ValueError(f"TokenData: only {tokens.size} tokens; need at least 10000")
        self.tokens = tokens
        self.vocab_size = vocab_size
        self.split = int(tokens.size * 0.95)

    @classmethod
    def stdlib(cls, max_bytes: int = 16 << 20) -> TokenData:
        return cls(np.memmap(stdlib_corpus(max_bytes), dtype=np.uint8, mode="r"))

    @classmethod
    def from_path(cls, path: str | os.PathLike) -> TokenData:
        """A directory of text files (bytes), or a Megatron ``prefix`` with .bin/.idx beside it."""
        p = Path(path)
        if p.with_suffix(".idx").exists() and p.with_suffix(".bin").exists():
            tokens = _read_megatron(p)
            return cls(tokens, vocab_size=int(tokens.max()) + 1)
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file())
            return cls(np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8))
        raise FileNotFoundError(f"data path {path!r}: neither a directory nor a Megatron prefix with .bin/.idx")

    def batch(
        self,
        step: int,
        rank: int,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        split: str = "train",
        device: torch.device | str = "cpu",
    ):
        """(inputs, targets) int64 [batch_size, seq_len] on `device`; a pure function of its
        arguments (the device aside)."""
        lo, hi = (0, self.split) if split == "train" else (self.split, self.tokens.size)
        g = np.random.default_rng([seed, step, rank, 0 if split == "train" else 1])
        starts = g.integers(lo, hi - seq_len - 1, size=batch_size)
        rows = np.stack([np.asarray(self.tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts])
        t = torch.from_numpy(rows)
        device = torch.device(device)
        if device.type == "cuda":
            # Pinned, so that the copy runs asynchronously to the host (it reads only the batch).
            t = t.pin_memory().to(device, non_blocking=True)
        elif device != torch.device("cpu"):
            t = t.to(device)
        return t[:, :-1], t[:, 1:]
