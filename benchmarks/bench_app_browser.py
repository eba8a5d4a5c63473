"""First load of each app page in real Chromium, on the 1-million-token study of bench_app.py.

    .venv/bin/python benchmarks/bench_app_browser.py                 # every page, Parquet study
    .venv/bin/python benchmarks/bench_app_browser.py --pages corrections overview --store X

For each page: a fresh `streamlit run apps/streamlit_app.py -- --study STORE` (warm-up thread on, as
`mismatch-lab app` runs it), a fresh headless Chromium context (no cached assets), then

    first    the page's URL opened as the first page of the session, until the page shows its last
             element and Streamlit no longer runs the script (what a user who opens that page waits);
    reload   the same page reloaded (a new session on the same server: caches filled).

Then one more server for a `tour`: every page in turn in one session, each its first visit after the
overview (the warm-up thread has had the overview's time to run ahead). Prints the CPU model and the
load average; writes benchmarks/out/bench_app_browser.json. Needs /usr/bin/chromium and Playwright
(as tests/app/test_app_browser.py).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "out"
APP = REPO / "apps" / "streamlit_app.py"
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
# url path -> a text the page draws last (its final section); the page counts as loaded once it shows
PAGES = {
    "overview": ("", "Precision table"),
    "volatility": ("volatility", "Dashed: PPO's clip range"),
    "clipping": ("clipping", "Top clipped tokens"),
    "corrections": ("corrections", "in the token inspector"),
    "inspector": ("inspector", "Cumulative log-ratio"),
    "training": ("training", "Sequences of a step"),
    "figures": ("figures", "Figures"),
}
TIMEOUT_MS = 300_000


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(store: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "streamlit", "run", str(APP), "--server.headless", "true", "--server.port",
           str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false",
           "--server.fileWatcherType", "none", "--", "--study", str(store)]
    with open(log, "ab") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env=dict(os.environ, MISMATCH_LAB_APP_WARMUP="1"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.read().strip() == b"ok":
                    return proc, url
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"streamlit did not start; see {log}")


def settle(page, text: str) -> None:
    page.get_by_text(text, exact=False).filter(visible=True).first.wait_for(timeout=TIMEOUT_MS)
    page.wait_for_function(
        "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')"
        " || !document.querySelector('[data-testid=\"stStatusWidget\"]').innerText.includes('Running')",
        timeout=TIMEOUT_MS)
    boxes = page.locator('[data-testid="stException"]')
    if boxes.count():
        raise SystemExit(f"the page raised: {boxes.first.inner_text()[:1000]}")


def load(page, url: str, name: str, *, reload: bool = False) -> float:
    path, text = PAGES[name]
    t0 = time.perf_counter()
    if reload:
        page.reload()
    else:
        page.goto(f"{url}/{path}")
    settle(page, text)
    return time.perf_counter() - t0


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def main(argv: list[str] | None = None) -> int:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", type=Path, default=OUT / "app-1000000", help="the study (bench_app.py builds it)")
    parser.add_argument("--pages", nargs="+", choices=list(PAGES), default=list(PAGES))
    parser.add_argument("--no-tour", action="store_true")
    args = parser.parse_args(argv)
    if not args.store.exists():
        raise SystemExit(f"{args.store} missing: run benchmarks/bench_app.py once to build it")
    OUT.mkdir(parents=True, exist_ok=True)
    log = OUT / "bench_app_browser.log"
    log.write_bytes(b"")
    load0, report = os.getloadavg(), {"pages": {}, "tour": {}}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        for name in args.pages:
            proc, url = serve(args.store, log)
            try:
                page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
                first = load(page, url, name)
                again = load(page, url, name, reload=True)
            finally:
                stop(proc)
            report["pages"][name] = {"first_s": first, "reload_s": again}
            print(f"{name:12s} first {first:6.2f} s   reload {again:6.2f} s", flush=True)
        if not args.no_tour:
            proc, url = serve(args.store, log)
            try:
                page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
                for name in PAGES:
                    report["tour"][name] = load(page, url, name)
                    print(f"tour {name:12s} {report['tour'][name]:6.2f} s", flush=True)
            finally:
                stop(proc)
        browser.close()
    load1 = os.getloadavg()
    report |= {"cpu": cpu_model(), "cores": os.cpu_count(), "load": [load0[0], load1[0]], "store": str(args.store),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"CPU: {report['cpu']}, {report['cores']} cores; load average {load0[0]:.2f} before, {load1[0]:.2f} after; "
          f"{report['date']}")
    (OUT / "bench_app_browser.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
