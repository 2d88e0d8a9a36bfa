"""A byte-level text corpus every machine has: the CPython standard library's sources.

The .py files under `os.path.dirname(os.__file__)` (Python's own `Lib/`, without
site-packages), read in sorted path order and joined with a blank line; tokens are bytes
(vocabulary 256). Every `val_every`-th file (by that order) is held out for validation, so
the split is deterministic and no file is in both. Batches are random windows drawn with a
seeded numpy Generator.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

VOCAB_SIZE = 256
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_files(root: str | None = None) -> list[str]:
    """The standard library's .py files, sorted."""
    root = root or os.path.dirname(os.__file__)
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        paths.extend(os.path.join(folder, f) for f in sorted(files) if f.endswith(".py"))
    return sorted(paths)


@dataclass
class Corpus:
    train: np.ndarray  # uint8 tokens
    val: np.ndarray
    n_files: int


def load_corpus(max_bytes: int | None = None, val_every: int = 20) -> Corpus:
    """Train/validation token arrays; `max_bytes` caps the bytes read (for quick runs)."""
    train, val, total = [], [], 0
    files = stdlib_files()
    if not files:
        raise RuntimeError(f"examples/data.py: no .py files under {os.path.dirname(os.__file__)}")
    used = 0
    for i, path in enumerate(files):
        with open(path, "rb") as f:
            data = f.read() + b"\n\n"
        (val if i % val_every == 0 else train).append(data)
        total += len(data)
        used += 1
        if max_bytes is not None and total >= max_bytes:
            break
    as_tokens = lambda parts: np.frombuffer(b"".join(parts), np.uint8).copy()  # noqa: E731
    return Corpus(train=as_tokens(train), val=as_tokens(val), n_files=used)


def batches(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int):
    """Endless (inputs, targets) int32 batches of shape (batch_size, seq_len)."""
    rng = np.random.default_rng(seed)
    high = len(tokens) - seq_len - 1
    if high <= 0:
        raise ValueError(f"examples/data.py: corpus of {len(tokens)} bytes is shorter than seq_len {seq_len}")
    offsets = np.arange(seq_len + 1)
    while True:
        starts = rng.integers(0, high, size=batch_size)
        window = tokens[starts[:, None] + offsets].astype(np.int32)
        yield window[:, :-1], window[:, 1:]
