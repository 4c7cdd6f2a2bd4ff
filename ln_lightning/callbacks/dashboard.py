"""The monitors' TensorBoard dashboard: a custom-scalars layout and depth-profile images.

TensorBoard's custom-scalars plugin reads ONE layout per run (the first `custom_scalars__config__`
event), so the layout of every ln_lightning monitor in `trainer.callbacks` is merged and written
once per writer by whichever monitor reaches `on_fit_start` first. If you write your own custom
scalars layout to the same run, merge ours into it with :func:`monitor_layout`.

Depth-profile images are drawn with Pillow (which TensorBoard's `add_image` needs anyway), not matplotlib.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from lightning.pytorch import Trainer

_WRITTEN_ATTR = "_ln_lightning_layout_written"


def monitor_layout(trainer: Trainer) -> dict[str, dict[str, list]]:
    """The merged custom-scalars layout of all ln_lightning monitors in `trainer.callbacks`.

    The format is `SummaryWriter.add_custom_scalars`': `{category: {chart title: ["Multiline", [regex, ...]]}}`.
    """
    from ln_lightning.callbacks._common import MonitorBase  # noqa: PLC0415 (import cycle)

    layout: dict[str, dict[str, list]] = {}
    for cb in trainer.callbacks:
        if isinstance(cb, MonitorBase):
            for category, charts in cb.dashboard_charts(trainer).items():
                layout.setdefault(category, {}).update(charts)
    if layout:
        # A post->pre transition in progress (LNPlacement(transition_steps=N)): its blend next to the stream charts.
        from ln_lightning._lightning_patch import find_placements  # noqa: PLC0415

        if any(getattr(p, "transition_steps", None) for p in find_placements(trainer)):
            category = next((c for c in layout if "residual stream" in c), "ln-lightning: placement")
            layout.setdefault(category, {})["placement transition (0 post-norm, 1 pre-norm)"] = ["Multiline", ["ln_placement/transition"]]
    return layout


def _writers(trainer: Trainer) -> list[Any]:
    out = []
    for logger in trainer.loggers:
        experiment = getattr(logger, "experiment", None)
        if callable(getattr(experiment, "add_custom_scalars", None)):
            out.append(experiment)
    return out


def write_layout_once(trainer: Trainer) -> None:
    """Write `monitor_layout(trainer)` to every TensorBoard writer of the trainer, once per writer, on rank 0."""
    if not trainer.is_global_zero:
        return
    writers = [w for w in _writers(trainer) if not getattr(w, _WRITTEN_ATTR, False)]
    if not writers:
        return
    layout = monitor_layout(trainer)
    if not layout:
        return
    for writer in writers:
        writer.add_custom_scalars(layout)
        setattr(writer, _WRITTEN_ATTR, True)


# Palette indices of the "P" images: white, grid grey, text black, then the series colours.
_COLORS = [(255, 255, 255), (225, 225, 225), (60, 60, 60),
           (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]
_WHITE, _GREY, _BLACK = 0, 1, 2
_SERIES = list(range(3, len(_COLORS)))


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


class DepthProfilePlot:
    """Renders "metric against block index" panels to an RGB array with Pillow, in about a millisecond.

    Matplotlib takes 50-200 ms per figure, which at every logging step would cost more than the
    monitors' whole time budget; Pillow is already needed by TensorBoard's `add_image`.
    """

    def __init__(self, panel_width: int = 420, height: int = 260):
        from PIL import ImageFont  # noqa: PLC0415

        self.panel_width = panel_width
        self.height = height
        try:
            self._font = ImageFont.load_default(size=11)
            self._title_font = ImageFont.load_default(size=13)
        except TypeError:  # Pillow < 10.1: fixed-size bitmap font
            self._font = self._title_font = ImageFont.load_default()

    def render_image(
        self,
        title: str,
        panels: list[tuple[str, dict[str, list[float]], bool]],
        xlabels: list[str],
        xlabel: str = "block index",
        bars: bool = False,
    ):
        """`panels`: [(y label, {series label: values per x}, log y)]. Returns a palette ("P") PIL image.

        A palette image draws and PNG-encodes several times faster than RGB (one byte per pixel).
        """
        from PIL import Image, ImageDraw  # noqa: PLC0415

        panel_width = min(1600, max(self.panel_width, 36 * len(xlabels)))
        width = panel_width * len(panels)
        image = Image.new("P", (width, self.height), 0)
        image.putpalette([c for rgb in _COLORS for c in rgb])
        draw = ImageDraw.Draw(image)
        draw.text((8, 4), title, fill=_BLACK, font=self._title_font)
        for k, (ylabel, series, log_y) in enumerate(panels):
            self._panel(draw, k * panel_width, panel_width, ylabel, series, log_y, xlabels, xlabel, bars)
        return image

    def render(self, *args, **kwargs) -> np.ndarray:
        """`render_image(...)` as an HWC uint8 RGB array."""
        return np.asarray(self.render_image(*args, **kwargs).convert("RGB"))

    def render_png(self, *args, **kwargs) -> tuple[bytes, int, int]:
        """`render_image(...)` encoded as PNG (fast zlib level): (bytes, height, width)."""
        image = self.render_image(*args, **kwargs)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", compress_level=1)
        return buffer.getvalue(), image.height, image.width

    @staticmethod
    def _text(draw, xy, text: str, fill, font, anchor: str | None = None) -> None:
        try:
            draw.text(xy, text, fill=fill, font=font, anchor=anchor)
        except ValueError:  # old Pillow's bitmap font has no anchors
            draw.text(xy, text, fill=fill, font=font)

    def _panel(self, draw, x0: int, panel_width: int, ylabel: str, series: dict[str, list[float]], log_y: bool,
               xlabels: list[str], xlabel: str, bars: bool) -> None:
        left, right, top, bottom = x0 + 62, x0 + panel_width - 14, 44, self.height - 46
        values = np.concatenate([np.asarray(v, dtype=float) for v in series.values()]) if series else np.array([])
        finite = values[np.isfinite(values)]
        # Log scale only where the values span decades (amplification, variance near eps).
        use_log = bool(log_y and finite.size and finite.min() > 0 and finite.max() / finite.min() > 20)
        tf = np.log10 if use_log else (lambda a: a)
        lo, hi = (float(tf(finite.min())), float(tf(finite.max()))) if finite.size else (0.0, 1.0)
        if bars:
            lo = min(lo, 0.0)
        if hi - lo < 1e-12 * max(1.0, abs(hi)):
            lo, hi = lo - 0.5 * max(abs(lo), 1e-3), hi + 0.5 * max(abs(hi), 1e-3)
        pad = 0.06 * (hi - lo)
        lo, hi = (lo if bars else lo - pad), hi + pad
        n = max(1, len(xlabels))

        def px(i: float) -> float:
            return left + (right - left) * (i + 0.5) / n

        def py(v: float) -> float:
            return bottom - (bottom - top) * (v - lo) / (hi - lo)

        grey, black = _GREY, _BLACK
        # Enough significant digits that neighbouring ticks differ (a narrow range around 1 needs 1.0032).
        span, mag = hi - lo, max(abs(lo), abs(hi), 1e-30)
        digits = 3 if use_log else min(8, max(3, 2 + int(np.ceil(np.log10(mag / span)))))
        for t in _ticks(lo, hi):
            y = py(t)
            draw.line([(left, y), (right, y)], fill=grey)
            label = f"{10 ** t:.3g}" if use_log else f"{t:.{digits}g}"
            self._text(draw, (left - 6, y), label, black, self._font, "rm")
        draw.rectangle([left, top, right, bottom], outline=black)
        step = max(1, int(np.ceil(n / 16)))
        for i in range(0, n, step):
            text = xlabels[i] if len(xlabels[i]) <= 14 else "…" + xlabels[i][-13:]
            self._text(draw, (px(i), bottom + 4 + 12 * (i // step % 2 if bars else 0)), text, black, self._font, "mt")
        self._text(draw, ((left + right) / 2, self.height - 4), xlabel, black, self._font, "md")
        self._text(draw, (x0 + 6, top - 6), ylabel + (" (log)" if use_log else ""), black, self._font, "ld")
        legend_x = left + 170
        for j, (label, vals) in enumerate(series.items()):
            color = _SERIES[j % len(_SERIES)]
            if len(series) > 1:
                self._text(draw, (legend_x + 80 * j, top - 6), label, color, self._font, "ld")
            y = np.asarray(vals, dtype=float)
            with np.errstate(divide="ignore", invalid="ignore"):
                ty = tf(np.where(y > 0, y, np.nan)) if use_log else y
            if bars:
                w = max(2.0, 0.7 * (right - left) / n)
                for i, v in enumerate(ty):
                    if np.isfinite(v):
                        draw.rectangle([px(i) - w / 2, py(v), px(i) + w / 2, py(max(lo, 0.0))], fill=color)
                continue
            points = [(px(i), py(v)) for i, v in enumerate(ty) if np.isfinite(v)]
            if len(points) > 1:
                draw.line(points, fill=color, width=2)
            for x, yy in points:
                draw.ellipse([x - 3, yy - 3, x + 3, yy + 3], fill=color)
