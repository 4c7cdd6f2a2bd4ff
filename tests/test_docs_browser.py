"""The documentation site in a real browser: built strictly, every guide reachable from the navigation.

Builds the site with mkdocs (in this process, strict as in CI), serves it on 127.0.0.1 and opens it in
Debian's headless Chromium through Playwright (the same set-up as the dashboard test: `executable_path`,
no browser download). From the home page it follows each guide's entry in the navigation and checks the
page's title, that its figures were filled in (no `{{` left) and that its images load.

Regenerate the screenshot the docs keep (docs/img/site_navigation.png):
    python tests/test_docs_browser.py docs/img/site_navigation.png
"""

from __future__ import annotations

import functools
import http.server
import os
import sys
import threading
from pathlib import Path

import pytest
from test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS, browser_or_skip

ROOT = Path(__file__).resolve().parents[1]
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))
# .ci/run sets this where it runs the file again after installing the docs extra: there a missing mkdocs fails.
REQUIRE_DOCS = bool(os.environ.get("LN_LIGHTNING_REQUIRE_DOCS"))


def _needs_or_skip() -> None:
    """Skip, saying what is missing, where the docs extra or Chromium is absent; in CI a missing browser fails."""
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        message = "the docs site browser test needs the docs extra (pip install -e '.[docs]')"
        if REQUIRE_DOCS:
            pytest.fail(message + " -- LN_LIGHTNING_REQUIRE_DOCS is set, so this is a failure, not a skip")
        pytest.skip(message)  # the suite's first run in .ci/run, before the docs extra is installed
    browser_or_skip("the docs site browser test")


def build_site(site_dir: Path) -> None:
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    build(load_config(str(ROOT / "mkdocs.yml"), site_dir=str(site_dir)))  # strict: mkdocs.yml says so


class SiteServer:
    """The built site on 127.0.0.1 (a thread of this process)."""

    def __init__(self, site_dir: Path):
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site_dir))
        handler.log_message = lambda *a, **k: None
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _title(guide: Path) -> str:
    return guide.read_text(encoding="utf-8").splitlines()[0].removeprefix("# ").strip()


def walk_navigation(url: str, screenshot: Path) -> dict[str, str]:
    """Open the home page, follow every guide in the navigation; {guide title: the page's h1}."""
    from playwright.sync_api import sync_playwright

    seen: dict[str, str] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            broken: list[str] = []
            page.on("response", lambda r: broken.append(r.url) if r.status >= 400 else None)
            page.goto(url + "/")
            page.get_by_role("heading", level=1).first.wait_for()
            page.screenshot(path=str(screenshot))
            nav = page.locator("nav.md-nav--primary")
            for guide in GUIDES:
                link = nav.get_by_role("link", name=_title_in_nav(guide), exact=True).first
                link.click()
                page.wait_for_load_state()
                h1 = page.locator("article h1").first.inner_text().replace("¶", "").strip()
                # The page's text outside code (a page may show the placeholder syntax in code, as the development guide does)
                prose = page.locator("article").evaluate(
                    "a => { const c = a.cloneNode(true); c.querySelectorAll('code, pre').forEach(e => e.remove()); return c.innerText; }")
                assert "{{" not in prose, f"{guide.name}: a placeholder was left in the page"
                for img in page.locator("article img").all():
                    assert img.evaluate("i => i.complete && i.naturalWidth > 0"), f"{guide.name}: image {img.get_attribute('src')} did not load"
                seen[guide.name] = h1
                page.goto(url + "/")
            assert not broken, f"requests that failed: {broken}"
        finally:
            browser.close()
    return seen


def _title_in_nav(guide: Path) -> str:
    import yaml

    nav = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=yaml.BaseLoader)["nav"]
    guides = next(item["Guides"] for item in nav if isinstance(item, dict) and "Guides" in item)
    rel = guide.relative_to(ROOT / "docs").as_posix()
    return next(title for item in guides for title, page in item.items() if page == rel)


@pytest.mark.slow
@pytest.mark.browser
def test_every_guide_is_reachable_from_the_navigation(tmp_path):
    # The docs extra is installed after the test suite's first run in .ci/run, which then runs this file again.
    _needs_or_skip()
    build_site(tmp_path / "site")
    server = SiteServer(tmp_path / "site")
    try:
        seen = walk_navigation(server.url, tmp_path / "home.png")
    finally:
        server.close()
    assert seen == {g.name: _title(g) for g in GUIDES}


if __name__ == "__main__":
    import tempfile

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/img/site_navigation.png").resolve()
    with tempfile.TemporaryDirectory() as tmp:
        build_site(Path(tmp) / "site")
        srv = SiteServer(Path(tmp) / "site")
        try:
            print(walk_navigation(srv.url, out))
        finally:
            srv.close()
    print(f"screenshot: {out}")
