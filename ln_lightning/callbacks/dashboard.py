"""The monitors' TensorBoard dashboard: a custom-scalars layout and depth-profile images.

TensorBoard's custom-scalars plugin reads ONE layout per run (the first `custom_scalars__config__`
event), so the charts of every :class:`DashboardPart` in `trainer.callbacks` (the ln_lightning
monitors) are merged and written once per writer by whichever monitor reaches `on_fit_start` first.
If you write your own custom scalars layout to the same run, merge ours into it with :func:`monitor_layout`.

Depth-profile images are drawn with Pillow (which TensorBoard's `add_image` needs anyway), not matplotlib.
This module knows nothing of the monitors themselves: they use it, never the other way round.
"""

from __future__ import annotations

import io
import logging
import weakref
from typing import Any

import numpy as np
from lightning.pytorch import Trainer
from lightning.pytorch.loggers.logger import DummyLogger
from PIL import Image, ImageDraw, ImageFont  # a dependency (TensorBoard's add_image needs it too)
from tensorboard.compat.proto.summary_pb2 import Summary

from ln_lightning._warnings import info, warn
from ln_lightning.callbacks._placement_lookup import placement_transition_configured

_log = logging.getLogger(__name__)
STABILITY = "ln-lightning: stability"  # the layout's section for spikes, clip rate and coefficient (several monitors add to it)
# Kept here, not as attributes on the user's writers and Trainers; weak, so they go with them.
_LAYOUT_WRITTEN: weakref.WeakSet = weakref.WeakSet()  # writers that have our custom-scalars layout
_SAID: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Trainer -> topics already said to it


class DashboardPart:
    """A callback that adds charts to the custom-scalars layout (every ln_lightning monitor does)."""

    def dashboard_charts(self, trainer: Trainer) -> dict[str, dict[str, list]]:
        """{category: {chart title: ["Multiline", [regex, ...]]}}, as `SummaryWriter.add_custom_scalars` takes."""
        return {}


def monitor_layout(trainer: Trainer) -> dict[str, dict[str, list]]:
    """The merged custom-scalars layout of all ln_lightning monitors in `trainer.callbacks`.

    The format is `SummaryWriter.add_custom_scalars`': `{category: {chart title: ["Multiline", [regex, ...]]}}`.
    """
    layout: dict[str, dict[str, list]] = {}
    for cb in trainer.callbacks:
        if isinstance(cb, DashboardPart):
            for category, charts in cb.dashboard_charts(trainer).items():
                layout.setdefault(category, {}).update(charts)
    # A placement transition in progress (LNPlacement(transition_steps=N)): its blend next to the stream charts.
    if layout and placement_transition_configured(trainer):
        category = next((c for c in layout if "residual stream" in c), "ln-lightning: placement")
        layout.setdefault(category, {})["placement transition (0 as trained, 1 converted)"] = ["Multiline", ["ln_placement/transition"]]
    return layout


def write_layout_once(trainer: Trainer) -> None:
    """Write `monitor_layout(trainer)` to every TensorBoard writer of the trainer, once per writer, on rank 0."""
    if not trainer.is_global_zero:
        return
    writers = [w for w in _experiments(trainer, "add_custom_scalars") if w not in _LAYOUT_WRITTEN]
    if not writers:
        return
    layout = monitor_layout(trainer)
    if not layout:
        return
    for writer in writers:
        writer.add_custom_scalars(layout)
        _LAYOUT_WRITTEN.add(writer)


def write_text(trainer: Trainer, tag: str, text: str, step: int) -> None:
    """`add_text` to every logger that takes text (a TensorBoard SummaryWriter), on rank 0."""
    if trainer.is_global_zero:
        for writer in _experiments(trainer, "add_text"):
            writer.add_text(tag, text, global_step=step)


def _experiments(trainer: Trainer, method: str, others: list[str] | None = None) -> list[Any]:
    """The loggers' experiments that have `method`; the other loggers' class names go to `others`."""
    out = []
    for logger in trainer.loggers:
        if isinstance(logger, DummyLogger):
            continue  # fast_dev_run: Lightning turned logging off, and said so
        try:
            experiment = logger.experiment
        except Exception:  # a logger whose experiment can't start here gets scalars only, through log_metrics
            experiment = None
        if callable(getattr(experiment, method, None)):
            out.append(experiment)
        elif others is not None:
            others.append(type(logger).__name__)
    return out


class DepthProfileWriter:
    """Writes one monitor's depth-profile images to every logger that takes images (a TensorBoard SummaryWriter).

    An image must never stop training: without Pillow, or when one fails, it warns and stays off for the
    run (the scalars are logged regardless).
    """

    def __init__(self, owner: str):
        self.owner = owner  # the monitor's class name, for the messages
        self._plot: DepthProfilePlot | None = None

    def write(self, trainer: Trainer, tag: str, step: int, **plot_kwargs) -> bool:
        """Render and write the image on rank 0; False when images are off from now on."""
        if not trainer.is_global_zero:
            return True
        others: list[str] = []
        writers = _experiments(trainer, "add_image", others)
        if others:
            _say_once(trainer, "no_images", f"ln_lightning monitors: {', '.join(sorted(set(others)))} takes no images, so the "
                      "depth-profile images are skipped there (the scalars are logged); a TensorBoardLogger shows them.")
        if not writers:
            return True
        if self._plot is None:
            self._plot = DepthProfilePlot()
        try:
            png, height, width = self._plot.render_png(**plot_kwargs)
            for writer in writers:
                get_file_writer = getattr(writer, "_get_file_writer", None)
                file_writer = get_file_writer() if callable(get_file_writer) else None
                if file_writer is not None:
                    # The PNG is already encoded (palette, fast zlib): hand it over as an image summary, as add_image would.
                    image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=png)
                    file_writer.add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)
                else:
                    writer.add_image(tag, self._plot.render(**plot_kwargs), global_step=step, dataformats="HWC")
        except Exception as err:  # an image must never stop training: turn images off, keep the scalars
            warn(f"{self.owner}: logging the depth-profile image failed ({type(err).__name__}: {err}); "
                 "images are off for the rest of this run, scalars are still logged.")
            return False
        return True


def _say_once(trainer: Trainer, key: str, message: str) -> None:
    """One info line per Trainer and topic, however many monitors run into it."""
    said = _SAID.setdefault(trainer, set())
    if key not in said:
        said.add(key)
        info(_log, message)


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
