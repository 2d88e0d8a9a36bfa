"""tools/sanitize_families.txt, the kernel families tools/gpu_check.sh runs under
compute-sanitizer: every CUDA source under csrc/ is named by some family's comment, and every
family's pytest arguments name existing test files and select GPU tests (collected here on
any machine; the GPU run itself is gpu_check.sh's)."""

from __future__ import annotations

import fnmatch
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ROOT / "tools" / "sanitize_families.txt"


def parse():
    """[(name, args, covered source patterns)] in file order; the patterns are the path-like
    words of the indented comment lines ("#   ...") between the previous family line and this
    one (the file's preamble, "# ...", names no sources)."""
    out, comments = [], []
    for line in FAMILIES.read_text().splitlines():
        if line.startswith("#   "):
            comments.append(line)
        elif line.startswith("#"):
            continue
        elif line.strip():
            name, _, args = line.partition(":")
            words = re.findall(r"[\w./*]+/[\w./*]*", " ".join(comments))
            patterns = [w.rstrip(".,") if w.startswith("csrc/") else "csrc/" + w.rstrip(".,") for w in words]
            out.append((name.strip(), shlex.split(args), patterns))
            comments = []
    return out


def covers(pattern: str, source: str) -> bool:
    return fnmatch.fnmatch(source, pattern) or source.startswith(pattern.rstrip("/") + "/")


def test_every_cuda_source_is_in_a_family():
    families = parse()
    assert len(families) >= 10
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cu"))
    assert sources, "no .cu files under csrc/"
    orphans = [s for s in sources if not any(covers(p, s) for _, _, pats in families for p in pats)]
    assert not orphans, f"CUDA sources no sanitize family names (add a line to {FAMILIES.name}): {orphans}"
    names = [n for n, _, _ in families]
    assert len(set(names)) == len(names), f"family names repeat: {names}"


def test_covers_matches_folders_files_and_patterns():
    assert covers("csrc/norm", "csrc/norm/norm_fwd.cu")
    assert not covers("csrc/norm", "csrc/normal/x.cu")
    assert covers("csrc/quantize/quantize_block*.cu", "csrc/quantize/quantize_block_1x128.cu")
    assert not covers("csrc/quantize/quantize_block*.cu", "csrc/quantize/quantize_fp8.cu")


@pytest.mark.parametrize("name,args", [(n, a) for n, a, _ in parse()], ids=[n for n, _, _ in parse()])
def test_family_selects_gpu_tests(name, args):
    files = [a for a in args if a.startswith("tests/")]
    assert files, f"{name}: no test file"
    for f in files:
        assert (ROOT / f).is_file(), f"{name}: {f} does not exist"
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                          "-p", "no:cacheprovider", *args], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode != 5, f"{name}: its filter selects no test"
    assert run.returncode == 0, f"{name}: collection failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
    selected = [line for line in run.stdout.splitlines() if "::" in line]
    assert all(line.split("::")[0] in files for line in selected)
