"""The dashboard in a real browser: TensorBoard's custom-scalars tab shows the monitors' charts.

Runs a tiny training with the four monitors (the "stability" section: SpikeMonitor's spike counts, the clip
rate and coefficient), starts `tensorboard --logdir` on 127.0.0.1 and opens
it in Debian's headless Chromium through Playwright (`executable_path`; Playwright never downloads
a browser here). Skips only when Chromium or Playwright is missing AND the CI variable is unset; in
CI a missing browser is a failure.

Regenerate the README screenshot from any log directory:
    python tests/test_dashboard_browser.py LOGDIR docs/img/dashboard.png
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("LN_LIGHTNING_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-default-apps", "--disable-extensions",
]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# chart title -> minimum number of series (lines) it must draw for the tiny run below (3 blocks, 6 norms, 6 groups)
EXPECTED_CHARTS = {
    "stream rms by block": 3,
    "update ratio by block": 3,
    "LN var_min by norm": 6,
    "LN var_mean by norm": 6,
    "LN amp_max": 6,
    "clip total norm": 1,
    "clip share by group": 6,
    "clip coef, clipped, fired fraction": 3,
    "clip dominant group (fired steps)": 6,
    "gradient norm after clipping by group (window mean)": 6,
    # the "ln-lightning: stability" section
    "spikes per logging window (spike/count)": 1,
    "spikes since the fit started": 1,
    "clip rate (fired fraction of the window's steps)": 1,
    "clip coefficient (window min, mean)": 2,
}
STABILITY_CHARTS = ("spikes per logging window (spike/count)", "spikes since the fit started",
                    "clip rate (fired fraction of the window's steps)", "clip coefficient (window min, mean)")


def browser_or_skip(what: str = "dashboard browser test") -> None:
    """Skip, naming what is missing, where Chromium or playwright is absent; in CI that fails (the docs browser
    test calls this too)."""
    missing = []
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        missing.append(f"Chromium at {CHROMIUM} (Debian: apt-get install -y chromium; LN_LIGHTNING_CHROMIUM names another)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright Python package (pip install playwright; no browser download needed)")
    if missing:
        message = f"{what} needs " + " and ".join(missing)
        if IN_CI:
            pytest.fail(message + " -- CI is set, so this is a failure, not a skip")
        pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorBoardServer:
    """`tensorboard --logdir DIR --host 127.0.0.1 --port FREE` as a subprocess, ready when its API answers."""

    def __init__(self, logdir: str | Path, timeout: float = 90.0):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
             "--port", str(self.port), "--reload_interval", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tensorboard exited with {self.proc.returncode}:\n{self.proc.stdout.read()}")
            try:
                # The custom-scalars layout endpoint answers once the run's events are loaded.
                body = urllib.request.urlopen(f"{self.url}/data/plugin/custom_scalars/layout", timeout=2).read()
                if b"category" in body:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"tensorboard did not serve a custom-scalars layout at {self.url} within {timeout:.0f}s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def open_custom_scalars(url: str, screenshot: str | Path, charts=EXPECTED_CHARTS, viewport=(1400, 3400)) -> dict[str, int]:
    """Open the custom-scalars dashboard, wait for every chart, save a screenshot; returns lines drawn per chart."""
    from playwright.sync_api import sync_playwright

    drawn: dict[str, int] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
            page.goto(f"{url}/#custom_scalars")
            cards = page.locator("tf-custom-scalar-multi-line-chart-card")
            for title in charts:
                card = cards.filter(has=page.get_by_text(title, exact=True)).first
                card.wait_for(state="visible", timeout=60_000)
                card.scroll_into_view_if_needed()  # TensorBoard renders cards lazily, when on screen
                lines = card.locator("path.line")
                matches = card.get_by_text("Matches (")
                deadline = time.monotonic() + 60
                while True:
                    drawn[title] = sum(1 for i in range(lines.count()) if len(lines.nth(i).get_attribute("d") or "") > 3)
                    text = matches.first.inner_text() if matches.count() else ""
                    matched = int(text.split("(")[1].split(")")[0]) if "(" in text else 0
                    if (drawn[title] >= charts[title] and matched >= charts[title]) or time.monotonic() > deadline:
                        break
                    time.sleep(0.25)
                drawn[title] = min(drawn[title], matched)  # a chart counts the series it drew AND matched
            page.evaluate("window.scrollTo(0, 0)")
            for el in page.locator("#center, .center, tf-custom-scalar-dashboard").all()[:1]:
                el.evaluate("e => e.scrollTop = 0")
            page.wait_for_timeout(500)  # let the last chart finish its transition before the screenshot
            page.screenshot(path=str(screenshot))
        finally:
            browser.close()
    return drawn


@pytest.mark.browser
@pytest.mark.slow
def test_custom_scalars_dashboard_renders_the_monitors(tmp_path):
    browser_or_skip()
    import json

    from ln_lightning.callbacks import SpikeMonitor
    from ln_lightning.testing.monitors import FixedBatchLM, all_monitors, make_data, make_trainer

    x, y = make_data(world=1, accum=2)
    trainer = make_trainer(str(tmp_path / "logs"), "browser", accelerator="cpu", devices=1, max_steps=6,
                       gradient_clip_val=0.05, callbacks=[*all_monitors(every=2), SpikeMonitor(every_n_steps=2)])
    trainer.fit(FixedBatchLM(x, y))

    server = TensorBoardServer(tmp_path / "logs")
    try:
        layout = json.loads(urllib.request.urlopen(f"{server.url}/data/plugin/custom_scalars/layout", timeout=10).read())
        drawn = open_custom_scalars(server.url, tmp_path / "dashboard.png")
    finally:
        server.close()
    sections = {c["title"]: [chart["title"] for chart in c["chart"]] for c in layout["category"]}
    assert sorted(sections["ln-lightning: stability"]) == sorted(STABILITY_CHARTS), sections
    for title, n_series in EXPECTED_CHARTS.items():
        assert drawn.get(title, 0) >= n_series, f"chart {title!r} drew {drawn.get(title, 0)} lines, expected >= {n_series}"
    assert (tmp_path / "dashboard.png").stat().st_size > 20_000


if __name__ == "__main__":  # screenshot of an existing log directory, e.g. examples/monitors_demo.py's
    logdir, out = sys.argv[1], sys.argv[2]
    srv = TensorBoardServer(logdir)
    try:
        charts = {t: 1 for t in EXPECTED_CHARTS if not t.startswith("clip dominant") and not t.startswith("clip coef")}
        print(open_custom_scalars(srv.url, out, charts=charts, viewport=(1500, 2600)))
    finally:
        srv.close()
