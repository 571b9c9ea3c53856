"""The HTML reports in a real browser: Debian's chromium + chromedriver, driven by selenium, networking off.

For a run report (ds4-504-per-class) and a sweep report (2 x 2 points of strata-658-borrow), opened from file://:
the page asks for nothing but itself (performance log: every request is file: or data:, no <script src>), the
console logs no error, every figure div became a plotly plot with an SVG of nonzero size and as many traces
(gd.data) as the Python figure object has (report_figures), each drew something, and a screenshot is not one
colour (decoded here with zlib, no imaging library).

Without chromium / chromedriver / selenium the tests skip, saying which is missing; with the environment variable CI
set they fail instead (.ci/run installs chromium and chromium-driver).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import zlib

import numpy as np
import pytest

from sim.simulate import run_scenario
from sim.results import write_results
from sim.explore.report import report_figures, write_report
from sim.scenario import load_scenario

RUN_SCENARIO = "scenarios/ds4-504-per-class.toml"
SWEEP_SCENARIO = "scenarios/strata-658-borrow.toml"
SWEEP_GRIDS = ["engine.flags.expert-cache=4000,5400", "engine.flags.vram-reserve-mib=1024,1536"]
WINDOW = (1280, 900)  # px: a laptop-sized viewport; plotly's responsive plots fill its width
RENDER_TIMEOUT_S = 60  # parsing the inline 4.8 MB plotly.js and drawing takes ~2 s here; slack for a loaded CI box
LOCAL_SCHEMES = ("file:", "data:", "blob:", "about:")  # plotly draws heatmaps through data: URLs


def _missing() -> str | None:
    for tool in ("chromium", "chromedriver"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH (apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return 'selenium is not installed (pip install -e ".[test]")'
    return None


@pytest.fixture(scope="module")
def driver():
    missing = _missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but the browser test cannot run: {missing}")
        pytest.skip(missing)
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox",  # root in a container: chromium's sandbox needs a user namespace
                "--disable-dev-shm-usage",  # containers' /dev/shm is often 64 MB, too small for a renderer
                f"--window-size={WINDOW[0]},{WINDOW[1]}",
                # no network: every host name fails to resolve and any proxied request goes to a closed port
                "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=http://127.0.0.1:9"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    browser = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    browser.set_network_conditions(offline=True, latency=0, download_throughput=0, upload_throughput=0)
    yield browser
    browser.quit()


@pytest.fixture(scope="module")
def run_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("browser-run")
    write_results(run_scenario(load_scenario(RUN_SCENARIO)), out / "run")
    write_report(out / "run", out / "run.html")
    return out / "run", out / "run.html"


@pytest.fixture(scope="module")
def sweep_report(tmp_path_factory):
    from sim.explore.sweep import expand_grid, run_sweep

    out = tmp_path_factory.mktemp("browser-sweep")
    run_sweep(expand_grid(SWEEP_SCENARIO, SWEEP_GRIDS), out / "sweep", executor="processes", workers=1)
    write_report(out / "sweep", out / "sweep.html")
    return out / "sweep", out / "sweep.html"


# --------------------------------------------------------------------------------------------- PNG


def _png_pixels(png: bytes) -> np.ndarray:
    """uint8 [height, width, channels] of an 8-bit RGB or RGBA, non-interlaced PNG (what chromium writes)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos: pos + 4])
        kind, data = png[pos + 4: pos + 8], png[pos + 8: pos + 8 + length]
        pos += 12 + length  # length, type, data, CRC
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", data)
        elif kind == b"IDAT":
            idat += data
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, f"unsupported PNG {header}"
    bpp = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    out = np.zeros((height, stride), np.uint8)
    prev = bytearray(stride)
    for y in range(height):  # undo each scanline's filter (PNG spec, section 9)
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1: (y + 1) * (stride + 1)])
        if kind == 1:  # Sub
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 255
        elif kind == 2:  # Up
            line = bytearray((np.frombuffer(line, np.uint8) + np.frombuffer(prev, np.uint8)).tobytes())
        elif kind == 3:  # Average
            for i in range(stride):
                left = line[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 255
        elif kind == 4:  # Paeth
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b, c = prev[i], prev[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        else:
            assert kind == 0, f"PNG filter {kind}"
        out[y] = np.frombuffer(line, np.uint8)
        prev = line
    return out.reshape(height, width, bpp)


def test_png_decoder_known_image():
    """The decoder on a 2 x 2 RGB image written here with each filter type, against the pixels it encodes."""
    pixels = np.array([[[10, 20, 30], [40, 50, 60]], [[70, 80, 90], [100, 110, 250]]], np.uint8)
    for kind in range(5):
        rows = []
        for y in range(2):
            line = pixels[y].reshape(-1).astype(int)
            prev = pixels[y - 1].reshape(-1).astype(int) if y else np.zeros(6, int)
            left = np.r_[np.zeros(3, int), line[:-3]]
            upleft = np.r_[np.zeros(3, int), prev[:-3]]
            if kind == 4:
                p = left + prev - upleft
                pred = np.where((abs(p - left) <= abs(p - prev)) & (abs(p - left) <= abs(p - upleft)), left,
                                np.where(abs(p - prev) <= abs(p - upleft), prev, upleft))
            else:
                pred = [np.zeros(6, int), left, prev, (left + prev) // 2][kind]
            rows.append(bytes([kind]) + bytes(((line - pred) % 256).astype(np.uint8)))
        chunk = (lambda kind, data: struct.pack(">I", len(data)) + kind + data
                 + struct.pack(">I", zlib.crc32(kind + data)))
        png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 2, 8, 2, 0, 0, 0))
               + chunk(b"IDAT", zlib.compress(b"".join(rows))) + chunk(b"IEND", b""))
        assert (_png_pixels(png) == pixels).all(), kind


# ------------------------------------------------------------------------------------------ browser


PLOTS_JS = """return Array.from(document.querySelectorAll('div.expertsim-plot')).map(function (gd) {
  var drawn = gd.querySelector('svg.main-svg'), box = drawn ? drawn.getBoundingClientRect() : {width: 0, height: 0};
  var rows = 0;  // the bottom of a table's last drawn row
  gd.querySelectorAll('rect.cell-rect').forEach(function (c) { rows = Math.max(rows, c.getBoundingClientRect().bottom); });
  return {id: gd.id, plotly: gd.classList.contains('js-plotly-plot'), traces: gd.data ? gd.data.length : -1,
          width: box.width, height: box.height, canvas: gd.querySelectorAll('canvas').length,
          marks: gd.querySelectorAll('g.trace, g.hm, g.table').length, done: gd.dataset.drawn === '1',
          below_rows: rows ? box.bottom - rows : null};
});"""


# Every x/y axis plotly drew (gd._fullLayout: the axes the figure's traces use) and every one the figure's own
# layout names (gd.layout), each with its title text; and a table's rows as data and as drawn cells.
AXES_JS = """return Array.from(document.querySelectorAll('div.expertsim-plot')).map(function (gd) {
  var axis = /^[xy]axis[0-9]*$/, title = function (a) { return (a && a.title && a.title.text) || ''; };
  var table = gd.data[0].type === 'table' ? gd.data[0] : null;
  return {id: gd.id,
          drawn: Object.keys(gd._fullLayout).filter(function (k) { return axis.test(k); })
            .map(function (k) { return [k, title(gd._fullLayout[k])]; }),
          declared: Object.keys(gd.layout).filter(function (k) { return axis.test(k); })
            .map(function (k) { return [k, title(gd.layout[k])]; }),
          columns: table ? table.cells.values.length : 0, rows: table ? table.cells.values[0].length : 0,
          cells: Array.from(gd.querySelectorAll('g.column-cell text.cell-text')).map(function (t) {
            return t.textContent; })};
});"""


def _check_page(driver, results, page):
    html = page.read_text(encoding="utf-8")
    assert not re.search(r"<script[^>]*\bsrc\s*=", html, flags=re.I)
    markup = re.sub(r"<script\b[^>]*>.*?</script>", "", html, flags=re.S | re.I)  # plotly.js names URLs in strings
    assert not re.search(r"\b(?:src|href)\s*=", markup, flags=re.I)  # no link, img or iframe outside scripts
    _, figures = report_figures(results)
    expected = [len(fig.data) for _, fig in figures]  # from the Python figure objects
    for log in ("browser", "performance"):  # reading a log empties it: this page's entries only from here
        driver.get_log(log)
    driver.get(page.resolve().as_uri())
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, RENDER_TIMEOUT_S).until(
        lambda d: all(p["plotly"] and p["width"] > 0 and p["done"] for p in d.execute_script(PLOTS_JS)))
    plots = driver.execute_script(PLOTS_JS)
    assert [p["id"] for p in plots] == [f"fig-{i}" for i in range(len(figures))]
    assert [p["traces"] for p in plots] == expected
    for p in plots:
        assert p["width"] > 0 and p["height"] > 0 and p["marks"] > 0, p
        # issue 34: no empty band under a table: its figure ends at its last row and the 20 px bottom margin
        assert p["below_rows"] is None or 0 <= p["below_rows"] <= 24, p
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []
    requests = [json.loads(e["message"])["message"] for e in driver.get_log("performance")]
    urls = [m["params"]["request"]["url"] for m in requests if m["method"] == "Network.requestWillBeSent"]
    assert urls and urls[0] == page.resolve().as_uri()
    assert [u for u in urls if not u.startswith(LOCAL_SCHEMES)] == []
    pixels = _png_pixels(driver.get_screenshot_as_png())
    colours, counts = np.unique(pixels.reshape(-1, pixels.shape[2]), axis=0, return_counts=True)
    assert len(colours) > 1 and counts.max() < 0.99 * counts.sum()  # not blank: more than one colour, drawn on
    axes = driver.execute_script(AXES_JS)
    for figure in axes:  # every axis of every figure has a title (a table has no axes)
        assert all(text.strip() for _, text in figure["drawn"] + figure["declared"]), figure
        assert {k for k, _ in figure["declared"]} <= {k for k, _ in figure["drawn"]}, figure
    return plots, axes


def test_run_report_in_browser(driver, run_report):
    plots, axes = _check_page(driver, *run_report)
    # headline, cache per class, notices, links, prefill and decode timelines, hit heatmap, miss-ratio curves
    assert len(plots) == 8
    assert sum(bool(figure["drawn"]) for figure in axes) == 4  # the four tables have no axes, the rest have


def test_sweep_report_in_browser(driver, sweep_report):
    plots, axes = _check_page(driver, *sweep_report)
    assert len(plots) == 5  # points table; decode and prefill tok/s, decode and prefill hit rate heatmaps (2 x 2 grid)
    points = axes[0]
    assert points["rows"] == 4 and points["columns"] > 0  # one row per point of the 2 x 2 grid
    # drawn: a header and 4 rows per column, and every grid value cell filled
    assert len(points["cells"]) == points["columns"] * (1 + points["rows"])
    assert all(cell.strip() for cell in points["cells"][1:1 + points["rows"]]), points["cells"]
    summary = driver.find_element("css selector", "p.expertsim-summary").text
    assert summary.startswith("Over 4 successful points (2 expert cache x 2 VRAM reserve): decode_tok_s ")
