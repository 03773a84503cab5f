"""`myria report`'s page renders in a real browser: Debian's headless Chromium through Playwright
(never a browser Playwright downloads itself), with the heat map and the blame table visible."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import threading

import pytest

from myria.observe.report import write_report
from tests.conftest import ROOT
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
        assert "waiting it caused" in table.inner_text()
        page.screenshot(path=str(out / "screenshot.png"), full_page=True)
        browser.close()
    assert (out / "screenshot.png").stat().st_size > 10_000


SPEEDSCOPE = ROOT / ".venv" / "speedscope" / "node_modules" / "speedscope" / "dist" / "release"


@pytest.mark.skipif(CHROMIUM is None or not (SPEEDSCOPE / "index.html").exists(),
                    reason="needs Debian's chromium and speedscope (make chromium viewer)")
def test_trace_opens_in_a_real_viewer(tmp_path):
    """speedscope, a trace viewer that imports Chrome trace JSON, loads trace.json with one
    profile per track (rank) and no error."""
    playwright = pytest.importorskip("playwright.sync_api")
    run = tmp_path / "run"
    run.mkdir()
    write_events(run)
    out = write_report(run, predict=False)
    site = tmp_path / "site"
    shutil.copytree(SPEEDSCOPE, site / "speedscope")
    shutil.copy(out / "trace.json", site / "trace.json")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *a, **k: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1300, "height": 800})
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{url}/speedscope/index.html#profileURL={url}/trace.json&title=myria")
            page.wait_for_function("document.body.innerText.includes('myria (1/')",
                                   timeout=30_000)
            text = page.inner_text("body")
            browser.close()
    finally:
        srv.shutdown()
    assert "myria (1/3)" in text, text[:300]  # 3 ranks -> 3 profiles
    assert not errors and "Something went wrong" not in text
