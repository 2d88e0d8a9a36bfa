"""What a benchmark step's peak device memory is made of: compiles one variant of the seed
Dense or layer step (tools/trace_step.py builds it), prints the compiled program's memory
analysis (arguments, outputs, temporaries, aliases) and, from XLA's buffer assignment, the
largest temporary buffers with the HLO values they hold. Compile only: nothing runs.

    python tools/memory_step.py layer fused_delayed [--top 25] [--dump DIR]
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=["dense", "layer"])
    parser.add_argument("variant")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--dump", default=None, help="keep XLA's dump here (default: a temp dir)")
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args()
    dump = args.dump or tempfile.mkdtemp()
    # The dump flags must be in place before the backend starts.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                               " --xla_dump_hlo_module_re=jit_compiled").strip()
    sys.path.insert(0, HERE)
    from trace_step import build

    step, step_args = build(args.which, args.variant, args.small)
    m = step.lower(*step_args).compile().memory_analysis()
    mib = 2.0 ** 20
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    print(f"{args.which} {args.variant}: arguments {m.argument_size_in_bytes / mib:.1f} MiB, outputs "
          f"{m.output_size_in_bytes / mib:.1f}, temporaries {m.temp_size_in_bytes / mib:.1f}, aliased "
          f"{m.alias_size_in_bytes / mib:.1f}; peak {peak / mib:.1f} MiB")
    reports = sorted(glob.glob(os.path.join(dump, "*jit_compiled*after_optimizations-buffer-assignment.txt")),
                     key=os.path.getsize)
    if not reports:
        print("no buffer assignment was dumped")
        return
    # "allocation N: size S, <attrs>:" then one " value: <id name @idx> (size=,offset=): shape"
    # line per HLO value it holds; the temporaries share one preallocated allocation.
    allocs, cur = [], None
    for line in open(reports[-1]):
        head = re.match(r"allocation (\d+): size (\d+), (.*)", line)
        if head:
            cur = (int(head.group(2)), head.group(3).rstrip(":\n"), [])
            allocs.append(cur)
        elif cur is not None and line.startswith(" value:"):
            v = re.match(r" value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)", line)
            if v:
                cur[2].append((int(v.group(2)), int(v.group(3)), v.group(1), v.group(4)))
    print(f"{len(allocs)} allocations in {os.path.basename(reports[-1])}")
    for size, attrs, values in sorted(allocs, key=lambda a: -a[0])[:args.top]:
        if size < 2 ** 20:
            break
        print(f"{size / 2**20:10.1f} MiB  {attrs[:100]}")
        if "temp" in attrs:  # the values that share it, largest first
            for vsize, off, name, shape in sorted(values, key=lambda v: -v[0])[:args.top]:
                if vsize >= 2 ** 20:
                    print(f"    {vsize / 2**20:9.1f} MiB @{off / 2**20:9.1f}  {name[:60]:60s} {shape[:60]}")

if __name__ == "__main__":
    main()
