"""The hottest SASS instructions of an Nsight Compute report, by warp-stall samples: reads
`ncu --import R.ncu-rep --page source --print-source sass --csv` (one kernel: add
`--kernel-name` / `--launch-skip`) on stdin and prints the top N instructions with their
sample counts and the stall columns that are non-zero for them, so a kernel's stalls can be
read where no Nsight Compute GUI is at hand (the device machine's report, as text).

    ncu --import k.ncu-rep --page source --print-source sass --csv | python tools/ncu_hot_sass.py 40
"""

from __future__ import annotations

import csv
import sys


def number(v: str) -> float | None:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return None


def main(top: int) -> None:
    rows = [r for r in csv.reader(sys.stdin) if r]
    header_at = next((i for i, r in enumerate(rows) if any("Sampling" in c for c in r)), None)
    if header_at is None:
        print("no warp-stall sampling columns in the input (was SourceCounters collected?)")
        return
    header, body = rows[header_at], rows[header_at + 1:]
    sample_cols = [i for i, c in enumerate(header) if "Sampling" in c]
    key = sample_cols[0]
    source = next((i for i, c in enumerate(header) if c.strip() in ("Source", "# Source")), 1)
    total = sum(number(r[key]) or 0.0 for r in body if len(r) > key)
    body = [r for r in body if len(r) > key and number(r[key])]
    body.sort(key=lambda r: -(number(r[key]) or 0.0))
    print(f"{header[key]}: {total:.0f} samples over {len(body)} instructions")
    for r in body[:top]:
        extras = []
        for i, c in enumerate(header):
            if i in (key, source) or "stall" not in c.lower():
                continue
            v = number(r[i]) if i < len(r) else None
            if v:
                extras.append(f"{c.strip()}={v:.0f}")
        share = 100.0 * (number(r[key]) or 0.0) / total if total else 0.0
        print(f"{share:5.1f}%  {r[source].strip()[:70]:70s}  {' '.join(extras)[:200]}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
