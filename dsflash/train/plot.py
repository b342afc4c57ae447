"""Loss curves as CSV and PNG (Pillow: the GPU machine has no matplotlib)."""

from __future__ import annotations

import csv
from pathlib import Path

from PIL import Image, ImageDraw

SERIES = (("backbone", "train_loss", (70, 110, 200)), ("backbone", "val_loss", (220, 90, 40)),
          ("dspark", "train_loss", (60, 160, 90)))
WIDTH, HEIGHT, MARGIN = 900, 500, 60
POINTS = 200  # a training loss is drawn as the means of blocks of ~1/POINTS of its steps: a step is one window of text


def block_means(series: list[tuple[int, float]]) -> tuple[list[tuple[int, float]], int]:
    """Means of each `span` consecutive losses (span: ~len/POINTS; one text window a step is noise), at their
    last step; and the span."""
    span = max(1, len(series) // POINTS)
    return [(series[i + span - 1][0], sum(v for _, v in series[i:i + span]) / span)
            for i in range(0, len(series) - span + 1, span)], span


def write_csv(rows: list[dict], path: Path) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)


def write_png(rows: list[dict], path: Path) -> None:
    """Each series' loss against its step (the phases side by side: DSpark steps follow the backbone's), the
    training losses as block means; series with no points left out of the legend."""
    last = max((r["step"] for r in rows if r["phase"] == "backbone"), default=0)
    points = {}
    for phase, key, colour in SERIES:
        series = [(r["step"] + (last if phase == "dspark" else 0), r[key]) for r in rows
                  if r["phase"] == phase and r.get(key) is not None]
        label = f"{phase} {key}"
        if key == "train_loss":
            series, span = block_means(series)
            label += f" (means of {span} steps)" if span > 1 else ""
        if series:
            points[(label, colour)] = series
    values = [v for series in points.values() for _, v in series]
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle([MARGIN, MARGIN // 2, WIDTH - MARGIN // 2, HEIGHT - MARGIN], outline="black")
    if values:
        lo, hi = min(values), max(values)
        hi = hi if hi > lo else lo + 1
        steps = max(s for series in points.values() for s, _ in series) or 1

        def xy(step: float, v: float) -> tuple[float, float]:
            return (MARGIN + (WIDTH - 1.5 * MARGIN) * step / steps,
                    HEIGHT - MARGIN - (HEIGHT - 1.5 * MARGIN) * (v - lo) / (hi - lo))

        for (_, colour), series in points.items():
            if len(series) > 1:
                draw.line([xy(s, v) for s, v in series], fill=colour, width=2)
        for i, (label, colour) in enumerate(points):
            draw.text((MARGIN + 10, MARGIN // 2 + 8 + 14 * i), label, fill=colour)
        draw.text((4, MARGIN // 2), f"{hi:.2f}", fill="black")
        draw.text((4, HEIGHT - MARGIN - 10), f"{lo:.2f}", fill="black")
        draw.text((WIDTH - MARGIN, HEIGHT - MARGIN + 8), f"step {steps}", fill="black")
    draw.text((MARGIN, HEIGHT - MARGIN + 24), "loss (nats/token) by step", fill="black")
    image.save(path)
