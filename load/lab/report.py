"""Results: the markdown file each comparison writes under
load/results/<date>/, the figures in it, and its plain SVG charts."""

import math
import os
import statistics

from . import kit


def write_results(name, text):
    os.makedirs(kit.RESULTS, exist_ok=True)
    with open(os.path.join(kit.RESULTS, name), "w") as f:
        f.write(text)
    print(text)
    kit.log(f"wrote {os.path.relpath(os.path.join(kit.RESULTS, name), kit.ROOT)}")


def quantile(sorted_values, q):
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def spread(values, fmt=".2f"):
    """"median M (min A, max B)" of values (ratios paired by round)."""
    v = sorted(values)
    return f"median {statistics.median(v):{fmt}} (min {v[0]:{fmt}}, max {v[-1]:{fmt}})"


def bar_chart(path, panels, labels, highlight, height):
    """Panels of bars one above the other, a bar per label, as plain SVG.
    panels: (title, a value per label, the value's format, log scale);
    highlight: per label, whether its bar stands out (the contender of
    interest)."""
    w, h, pad, gap = 760, height, 60, 20
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h * len(panels)}" '
             'font-family="sans-serif" font-size="12">', '<rect width="100%" height="100%" fill="white"/>']
    for i, (title, vals, fmt, log_scale) in enumerate(panels):
        top = i * h
        scale = (lambda v: math.log10(v + 1)) if log_scale else (lambda v: v)
        vmax = max(scale(v) for v in vals) or 1
        bw = (w - 2 * pad) / len(labels) - gap
        base = top + h - 40
        parts.append(f'<text x="{pad}" y="{top + 24}" font-size="14" font-weight="bold">{title}</text>')
        parts.append(f'<line x1="{pad}" y1="{base}" x2="{w - pad}" y2="{base}" stroke="#333"/>')
        for j, (label, v, strong) in enumerate(zip(labels, vals, highlight)):
            x = pad + j * (bw + gap) + gap / 2
            bh = (h - 90) * scale(v) / vmax
            color = "#2b7bb9" if strong else "#9aa5b1"
            parts.append(f'<rect x="{x:.1f}" y="{base - bh:.1f}" width="{bw:.1f}" height="{bh:.1f}" fill="{color}"/>')
            parts.append(f'<text x="{x + bw / 2:.1f}" y="{base - bh - 4:.1f}" text-anchor="middle">{fmt.format(v)}</text>')
            parts.append(f'<text x="{x + bw / 2:.1f}" y="{base + 16}" text-anchor="middle">{label}</text>')
    parts.append("</svg>")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(parts))
