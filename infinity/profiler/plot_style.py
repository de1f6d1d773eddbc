"""What every plot shares: the colours of a step's parts and a matplotlib figure made on demand."""

from __future__ import annotations

PART_COLOURS = {"compute": "#43a047", "stall": "#e53935", "serial I/O": "#fb8c00", "other": "#bdbdbd"}


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed."""


def figure(height: float = 4.0, rows: int = 1, ratios: list[float] | None = None, width: float = 11.0):
    """A Figure and its axes (a list when `rows` > 1, x shared); raises PlotsUnavailable without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotsUnavailable(
            "matplotlib is not installed, so no PNG plots: pip install 'infinity[plots]' (or pip install matplotlib)"
        ) from exc
    fig = Figure(figsize=(width, height), layout="constrained")
    if rows == 1:
        return fig, fig.add_subplot()
    return fig, list(fig.subplots(rows, 1, sharex=True, gridspec_kw={"height_ratios": ratios or [1] * rows}))
