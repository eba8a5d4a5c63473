"""The app in a real browser: served by `streamlit run` on localhost, driven by headless system Chromium.

Needs Debian's `chromium` (apt-get install chromium chromium-driver); Playwright drives that binary and
never downloads a browser of its own. Without chromium the test skips locally and fails in CI
(`CI` set). Screenshots of every page go to tests/screenshots/ (git-ignored).

    .venv/bin/python -m pytest tests/app -m browser -q
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
from app_paths import APP, REPO

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = REPO / "tests" / "screenshots"
# docs/environment.md, "Browser tests": the flags a headless Chromium needs here
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# url path of each page (st.Page derives it from the file name; the default page is "/") and a text it shows
PAGES = {
    "overview": ("", "Precision table"),
    "volatility": ("volatility", "Dashed: PPO's clip range"),
    "clipping": ("clipping", "Top clipped tokens"),
    "corrections": ("corrections", "Tokens a method drops"),
    "inspector": ("inspector", "Cumulative log-ratio"),
    "training": ("training", "Sequences of a step"),
    "figures": ("figures", "fig1 ratio vs mu"),
}
START_TIMEOUT_S = 60
RENDER_TIMEOUT_MS = 45_000

pytestmark = pytest.mark.browser


def _require_browser():
    """Skip (locally) or fail (in CI) when the system browser or Playwright is missing."""
    missing = None
    if not CHROMIUM.is_file():
        missing = f"{CHROMIUM} not found: install it with `apt-get install -y chromium chromium-driver`"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            missing = "playwright is not installed: `pip install -e .[dev]`"
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"browser test cannot run in CI: {missing}")
        pytest.skip(missing)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_cache(tmp_path_factory) -> Path:
    """The served app's results cache folder (MISMATCH_LAB_CACHE), empty at start."""
    return tmp_path_factory.mktemp("served-results-cache")


@pytest.fixture(scope="module")
def served_app(tmp_path_factory, study_dir, server_cache):
    """`streamlit run apps/streamlit_app.py -- --study <fixture study>` on a free port; yields its URL."""
    _require_browser()
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "streamlit.log"
    cmd = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.headless",
        "true",
        "--server.port",
        str(port),
        "--server.address",
        "127.0.0.1",
        "--browser.gatherUsageStats",
        "false",
        "--server.fileWatcherType",
        "none",
        "--",
        "--study",
        str(study_dir),
    ]
    # the real server runs its warm-up thread; its results cache goes to a folder of this module
    env = dict(os.environ, MISMATCH_LAB_APP_WARMUP="1", MISMATCH_LAB_CACHE=str(server_cache))
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"streamlit did not start (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def browser_page(served_app, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")  # a fresh --user-data-dir
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()
            shutil.rmtree(profile, ignore_errors=True)


def _settle(page, expected_text: str) -> None:
    """Wait until the page shows its expected text and Streamlit has finished running the script."""
    page.get_by_text(expected_text, exact=False).filter(visible=True).first.wait_for(timeout=RENDER_TIMEOUT_MS)
    page.wait_for_function(
        "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')"
        " || !document.querySelector('[data-testid=\"stStatusWidget\"]').innerText.includes('Running')",
        timeout=RENDER_TIMEOUT_MS,
    )
    page.wait_for_timeout(500)  # let charts finish drawing before the screenshot


def _no_exception(page, where: str) -> None:
    boxes = page.locator('[data-testid="stException"]')
    assert boxes.count() == 0, f"{where}: Streamlit exception shown: {boxes.first.inner_text()[:2000]}"


@pytest.mark.parametrize("name", list(PAGES))
def test_each_page_renders_in_chromium_without_an_exception(served_app, browser_page, name):
    path, expected = PAGES[name]
    page = browser_page
    page.goto(f"{served_app}/{path}")
    _settle(page, expected)
    _no_exception(page, name)
    assert page.locator("h1").first.inner_text().strip() != ""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def test_the_inspector_colours_tokens_and_jumps_to_the_worst_sequence(served_app, browser_page):
    page = browser_page
    page.goto(f"{served_app}/inspector")
    _settle(page, "Cumulative log-ratio")
    assert page.locator("span[title^='pos ']").count() > 5  # the coloured response, one span per token
    page.get_by_text("Worst sequences by max |Δp|").click()
    _settle(page, "Worst 50 sequences")
    _settle(page, "Token detail")
    _no_exception(page, "inspector, worst sequences")
    page.get_by_text("mask decision").click()
    _settle(page, "PPO clips only")
    _no_exception(page, "inspector, mask colours")
    page.screenshot(path=str(SCREENSHOTS / "inspector_worst_mask.png"), full_page=True)


def test_the_training_step_button_opens_the_inspector(served_app, browser_page):
    page = browser_page
    page.goto(f"{served_app}/training")
    _settle(page, "Sequences of a step")
    page.get_by_role("button", name="Open step 2 in the token inspector").click()
    _settle(page, "Token detail")
    _no_exception(page, "inspector opened from training")
    assert page.url.rstrip("/").endswith("/inspector")
    assert page.locator("h1", has_text="Token inspector").count() == 1
    page.screenshot(path=str(SCREENSHOTS / "inspector_from_training.png"), full_page=True)


def test_the_corrections_page_opens_a_dropped_sequence_in_the_inspector(served_app, browser_page):
    page = browser_page
    page.goto(f"{served_app}/corrections")
    _settle(page, "Tokens a method drops")
    _no_exception(page, "corrections")
    page.get_by_role("button", name="in the token inspector").click()
    _settle(page, "Token detail")
    _no_exception(page, "inspector opened from corrections")
    assert page.url.rstrip("/").endswith("/inspector")
    assert page.locator("h1", has_text="Token inspector").count() == 1
    page.screenshot(path=str(SCREENSHOTS / "inspector_from_corrections.png"), full_page=True)


def test_the_served_app_keeps_what_it_computed_in_its_results_cache_outside_the_study(
        served_app, browser_page, server_cache, study_dir):
    page = browser_page
    page.goto(f"{served_app}/")
    _settle(page, "Precision table")
    _no_exception(page, "overview")
    entries = list(server_cache.glob("*/*/*.pkl"))  # <store's cache>/<query>/<fingerprint>.pkl
    assert entries, "the served app wrote no results cache"
    assert not list(study_dir.rglob(".mismatch-lab-cache*")), "a cache was written into a study that is not ours"
