"""`myria report`'s page renders in a real browser: Debian's headless Chromium through Playwright
(never a browser Playwright downloads itself), with the heat map and the blame table visible."""

from __future__ import annotations

import json
import shutil

import pytest

from myria.observe.report import write_report
from tests.observe.test_timeline import write_events

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make chromium)")
def test_report_renders_in_headless_chromium(tmp_path):
    playwright = pytest.importorskip("playwright.sync_api")
    run = tmp_path / "run"
    run.mkdir()
    write_events(run)  # a small 3-rank run's events
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 1000.0, "mfu": 0.4}) + "\n"
        for s in range(1, 5)))
    out = write_report(run, predict=False)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        page.goto((out / "index.html").as_uri())
        heat = page.locator("img#heatmap")
        assert heat.is_visible()
        box = heat.bounding_box()
        assert box["width"] > 200 and box["height"] > 100
        # the image decoded (a broken image has no natural size)
        assert page.evaluate("document.getElementById('heatmap').naturalWidth") > 200
        table = page.locator("table#blame")
        assert table.is_visible()
        rows = table.locator("tr")
        assert rows.count() == 1 + 3  # header + one row per rank
        assert "others waited on it" in table.inner_text()
        page.screenshot(path=str(out / "screenshot.png"), full_page=True)
        browser.close()
    assert (out / "screenshot.png").stat().st_size > 10_000
