"""Opcode counts of dumped SASS: what a compiled kernel's instructions are made of.

Reads every file under DIR whose name contains "sass" (what Mosaic GPU writes with
MOSAIC_GPU_DUMP_SASS=1 and MOSAIC_GPU_DUMP_TO=DIR, or `gpu_run.sh qmm` with SASS=1 makes by
ptxas and cuobjdump) and prints, per file, its instruction count and the most frequent
opcodes (the mnemonic before the first '.', or with --full the whole of it; predicates
dropped).

    python -m strata_jax.benchmarks.sass_stats /tmp/mosaic_dump --top 30
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

# "/*0450*/   @!P0 LOP3.LUT R4, R2, 0xf, RZ, 0xc0, !PT ;"
_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?")


def opcode_counts(text: str, full: bool = False) -> collections.Counter:
    """Instruction mnemonics of SASS `text` (with their modifiers when `full`)."""
    c = collections.Counter()
    for m in _INSTR.finditer(text):
        c[m.group(1) + (m.group(2) or "") if full else m.group(1)] += 1
    return c


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--full", action="store_true", help="count opcodes with their modifiers")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = {}
    for root, _, files in os.walk(args.dir):
        for name in sorted(files):
            if "sass" not in name.lower():
                continue
            path = os.path.join(root, name)
            with open(path, errors="replace") as f:
                c = opcode_counts(f.read(), args.full)
            if not c:
                continue
            total = sum(c.values())
            out[name] = {"instructions": total, "opcodes": dict(c.most_common())}
            print(f"{name}: {total} instructions")
            print("  " + ", ".join(f"{op} {n}" for op, n in c.most_common(args.top)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
