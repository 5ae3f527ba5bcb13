"""The report's colour scale: diverging, centred at zero (blue below, red above, grey for no data)."""
from __future__ import annotations

NEG, MID, POS = (33, 102, 172), (247, 247, 247), (178, 24, 43)


def colour(value, limit) -> str:
    if value is None:
        return "#d9d9d9"
    t = max(-1.0, min(1.0, value / limit)) if limit else 0.0
    end = POS if t > 0 else NEG
    a = abs(t)
    rgb = tuple(round(m + (e - m) * a) for m, e in zip(MID, end))
    return "#{:02x}{:02x}{:02x}".format(*rgb)


GROUP_COLOURS = {"top": colour(1.0, 1.0), "random": colour(-1.0, 1.0)}  # red, blue: the scale's ends
# The lines of a figure with several series (curves), in legend order: red, blue, green, purple, orange, teal
SERIES_COLOURS = ("#b2182b", "#2166ac", "#1b7837", "#762a83", "#e08214", "#35978f")
