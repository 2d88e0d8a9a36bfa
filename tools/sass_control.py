"""Rewrite the scheduling control bits of chosen instructions in a cubin (an experiment tool).

ptxas sets, on every SASS instruction, a few scheduling bits beside the operation: a stall
count, a yield hint, scoreboard barriers and operand-reuse flags. In the Volta-and-later
encoding (one 128-bit instruction, two little-endian 64-bit words) they sit in the high word:
stall bits 41-44, yield bit 45, reuse flags 58-61. nvcc 13 writes the block GEMM's
promotion (csrc/gemm/block_gemm_sm90_kernel.cuh: 96 FFMAs per K block) with bit 45 alternating
between 0 and 1 and bit 45 = 1 on every instruction that sets a reuse flag. Whether the warp
scheduler switches warps more often through that stretch was one of the two levers on the
promotion left untried (docs/performance.md has the result): this tool writes the variants, and
LOWBIT_BLOCK_GEMM_CUBIN=<cubin> runs one in place of the built kernel.

    python tools/sass_control.py IN.cubin OUT.cubin --policy yield0 [--every N] [--ops FFMA] [--function BlockGemmKernel]

Policies on each chosen instruction (opcode in --ops, in a function whose name holds
--function): "keep" (a byte copy: checks the override path itself), "yield0" (bit 45 = 0 and
no reuse flags; with --every N only on every N-th chosen instruction of a function, the others
bit 45 = 1 with their reuse flags kept), "yield1" (bit 45 = 1, reuse flags kept). yield0 leaves
bit 45 alone where the instruction before sets a reuse flag, so no reuse is ever followed by
a bit-45 = 0 instruction that ptxas did not write that way. bit 45 = 0 is the hint to switch
warps: ptxas never writes it on an instruction that sets a reuse flag. The instruction words are read from
`cuobjdump -sass` and checked against the file's bytes (each function's .text.<name> section)
before anything is written. No semantics change: only scheduling hints and the operand
cache, which the block GEMM GPU tests check on the result.
"""
import argparse
import re
import shutil
import struct
import subprocess
import sys

YIELD_BIT = 1 << 45
REUSE_MASK = 0xF << 58


def text_sections(blob):
    """{section name: (file offset, size)} of a 64-bit little-endian ELF."""
    if blob[:4] != b"\x7fELF" or blob[4] != 2 or blob[5] != 1:
        raise SystemExit("sass_control: not a 64-bit little-endian ELF (a cubin)")
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize) for i in range(shnum)]
    strtab_off, strtab_size = headers[shstrndx][4], headers[shstrndx][5]
    names = blob[strtab_off:strtab_off + strtab_size]
    out = {}
    for h in headers:
        name = names[h[0]:names.index(b"\0", h[0])].decode()
        out[name] = (h[4], h[5])
    return out


def listing(cuobjdump, path):
    """[(function, offset, opcode, low word, high word)] from cuobjdump -sass."""
    text = subprocess.run([cuobjdump, "-sass", path], check=True, capture_output=True, text=True).stdout
    rows, function, pending = [], None, None
    first = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);\s*/\* (0x[0-9a-f]{16}) \*/")
    second = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            function, pending = m.group(1), None
            continue
        m = first.search(line)
        if m:
            body = re.sub(r"^@!?U?P[T0-9]+\s+", "", m.group(2).strip())
            pending = (int(m.group(1), 16), body.split()[0] if body else "", int(m.group(3), 16))
            continue
        m = second.match(line)
        if m and pending is not None and function is not None:
            rows.append((function, pending[0], pending[1], pending[2], int(m.group(1), 16)))
            pending = None
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--policy", choices=("keep", "yield0", "yield1"), required=True)
    parser.add_argument("--ops", default="FFMA", help="comma-separated opcodes (base name, e.g. FFMA,FMUL)")
    parser.add_argument("--every", type=int, default=1, help="yield0: every N-th chosen instruction only")
    parser.add_argument("--function", default="BlockGemmKernel")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    args = parser.parse_args(argv)
    if args.every < 1:
        parser.error("--every: expected N >= 1")
    ops = set(args.ops.split(","))
    blob = bytearray(open(args.src, "rb").read())
    sections = text_sections(blob)
    rows = listing(args.cuobjdump, args.src)
    by_function = {}
    for row in rows:
        by_function.setdefault(row[0], []).append(row)
    chosen = changed = 0
    for function, instrs in by_function.items():
        if args.function not in function:
            continue
        base, size = sections[".text." + function]
        prev_high, nth = 0, 0
        for _, offset, opcode, low, high in instrs:
            at = base + offset
            if offset + 16 > size or struct.unpack_from("<QQ", blob, at) != (low, high):
                raise SystemExit(f"sass_control: {function}+{offset:#x}: the listing and the bytes differ")
            new = high
            if opcode.split(".")[0] in ops:
                chosen += 1
                nth += 1
                if args.policy == "yield0" and (nth - 1) % args.every == 0:
                    new &= ~REUSE_MASK
                    if not prev_high & REUSE_MASK:
                        new &= ~YIELD_BIT
                elif args.policy != "keep":  # yield1, or yield0 off its every-N-th
                    new |= YIELD_BIT
            if new != high:
                struct.pack_into("<Q", blob, at + 8, new)
                changed += 1
            prev_high = new
    open(args.dst, "wb").write(bytes(blob))
    print(f"sass_control: {args.policy}: {chosen} {','.join(sorted(ops))} instructions in "
          f"{sum(args.function in f for f in by_function)} functions, {changed} rewritten -> {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
