#!/usr/bin/env python3
"""Writes bench/throughput.svg: library claim -> complete -> replay cycles per second
against concurrency, one line per backend (solid) and its raw baseline (dashed), from the
CSV that bench/cycles.sh appends to (bench/results/cycles.csv). Standard library only.

    python3 bench/plot.py [bench/results/cycles.csv] [bench/throughput.svg]
"""

import csv
import math
import sys
from collections import defaultdict

COLOURS = {
    "memory": "#6b7280",
    "redb": "#d62728",
    "sqlite": "#1f77b4",
    "redis": "#2ca02c",
    "postgres": "#9467bd",
}


def main() -> None:
    src = sys.argv[1] if len(sys.argv) > 1 else "bench/results/cycles.csv"
    dst = sys.argv[2] if len(sys.argv) > 2 else "bench/throughput.svg"
    lib: dict[str, dict[int, float]] = defaultdict(dict)
    base: dict[str, dict[int, float]] = defaultdict(dict)
    with open(src, newline="") as f:
        for row in csv.reader(f):
            if not row or row[0] == "backend":
                continue
            backend, conc, cycle = row[0], int(row[1]), row[2]
            if cycle != "claim+complete+replay":
                continue
            # The last row for a (backend, concurrency) wins: re-runs replace earlier ones.
            lib[backend][conc] = float(row[4])
            if row[7] and float(row[7]) > 0:
                base[backend][conc] = float(row[7])

    concs = sorted({c for d in lib.values() for c in d})
    values = [v for d in list(lib.values()) + list(base.values()) for v in d.values() if v > 0]
    lo = 10 ** math.floor(math.log10(min(values)))
    hi = 10 ** math.ceil(math.log10(max(values)))
    w, h, left, right, top, bottom = 760, 460, 80, 170, 40, 60
    pw, ph = w - left - right, h - top - bottom

    def x(c: int) -> float:
        i = concs.index(c)
        return left + (pw * i / max(1, len(concs) - 1))

    def y(v: float) -> float:
        return top + ph * (1 - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)))

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{left}" y="22" font-size="14" font-weight="bold">idem: claim -> complete -> replay cycles/s '
        "(log scale)</text>",
    ]
    decade = lo
    while decade <= hi:
        for m in (1, 2, 5):
            v = decade * m
            if lo <= v <= hi:
                out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#e5e7eb"/>')
                out.append(f'<text x="{left - 8}" y="{y(v) + 4:.1f}" text-anchor="end">{v:,.0f}</text>')
        decade *= 10
    for c in concs:
        out.append(f'<line x1="{x(c):.1f}" x2="{x(c):.1f}" y1="{top}" y2="{top + ph}" stroke="#e5e7eb"/>')
        out.append(f'<text x="{x(c):.1f}" y="{top + ph + 18}" text-anchor="middle">{c}</text>')
    out.append(
        f'<text x="{left + pw / 2:.1f}" y="{h - 15}" text-anchor="middle">concurrent callers</text>'
    )
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#9ca3af"/>')
    ly = top + 10
    for backend in [b for b in COLOURS if b in lib]:
        colour = COLOURS[backend]
        for series, dash, label in ((lib, "", backend), (base, "6,4", f"{backend} baseline")):
            pts = sorted(series.get(backend, {}).items())
            if not pts:
                continue
            path = " ".join(f"{x(c):.1f},{y(v):.1f}" for c, v in pts)
            dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"{dash_attr}/>')
            for c, v in pts:
                out.append(f'<circle cx="{x(c):.1f}" cy="{y(v):.1f}" r="3" fill="{colour}"/>')
            out.append(
                f'<line x1="{left + pw + 12}" x2="{left + pw + 36}" y1="{ly}" y2="{ly}" stroke="{colour}" '
                f'stroke-width="2"{dash_attr}/>'
            )
            out.append(f'<text x="{left + pw + 42}" y="{ly + 4}">{label}</text>')
            ly += 18
    out.append("</svg>")
    with open(dst, "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
