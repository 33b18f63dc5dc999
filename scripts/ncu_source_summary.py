"""Summarize an Nsight Compute source page (``ncu -i REPORT --page source --csv --print-source cuda,sass``):
warp stall samples by reason and by source line, so "where the time goes" names lines, not guesses.

    python scripts/ncu_source_summary.py close-source.csv [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import csv
import linecache
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _int(x: str) -> int:
    try:
        return int(float(x or 0))
    except ValueError:
        return 0


def summarize(path: Path, top: int) -> str:
    by_line: collections.Counter = collections.Counter()
    executed: collections.Counter = collections.Counter()
    reasons: collections.Counter = collections.Counter()
    line_reasons: dict = collections.defaultdict(collections.Counter)
    sources: dict = {}
    file, idx = None, None
    for row in csv.reader(path.open()):
        if not row:
            continue
        if row[0] == "File Path":
            file = row[1]
            continue
        if row[0] == "Line No":
            idx = {name: i for i, name in enumerate(row)}
            continue
        if idx is None or not row[0].isdigit():
            continue
        key = (file, int(row[0]))
        sources.setdefault(key, row[1].strip())
        samples = _int(row[idx[SAMPLES]])
        by_line[key] += samples
        executed[key] += _int(row[idx[EXECUTED]])
        for name, i in idx.items():
            if name.startswith("stall_") and "Not Issued" not in name:
                reasons[name[6:]] += _int(row[i])
                line_reasons[key][name[6:]] += _int(row[i])
    total = sum(by_line.values())
    out = [f"source: {path.name}; {total} warp stall samples, {sum(executed.values())} warp instructions", ""]
    out.append("| stall reason | samples | share |")
    out.append("| --- | ---: | ---: |")
    for name, n in reasons.most_common(10):
        out.append(f"| {name} | {n} | {100 * n / max(1, sum(reasons.values())):.1f}% |")
    out += ["", "| file:line | samples | share | warp instructions | top reasons | source |",
            "| --- | ---: | ---: | ---: | --- | --- |"]  # fmt: skip
    for key, n in by_line.most_common(top):
        why = ", ".join(f"{r} {c}" for r, c in line_reasons[key].most_common(3))
        text = sources.get(key) or linecache.getline(key[0] or "", key[1]).strip()
        out.append(f"| {Path(key[0] or '?').name}:{key[1]} | {n} | {100 * n / max(1, total):.1f}% | "
                   f"{executed[key]} | {why} | `{text[:90]}` |")  # fmt: skip
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    if not args.csv.exists():
        raise SystemExit(f"{args.csv}: no such file")
    print(summarize(args.csv, args.top), end="")


if __name__ == "__main__":
    main()
