"""First load and interactions of each app page in real Chromium, on the 1-million-token study of bench_app.py.

    .venv/bin/python benchmarks/bench_app_browser.py                 # every page, Parquet study
    .venv/bin/python benchmarks/bench_app_browser.py --pages corrections overview --store X
    .venv/bin/python benchmarks/bench_app_browser.py --interactions-only   # --prepare, then the interactions

The code measured is that of a commit (`--commit`, default HEAD: commit first), extracted under benchmarks/out/.
First `mismatch-lab app --prepare` fills the study's results cache (mismatch_lab/store/cache.py; wall and CPU
seconds printed), in a cache folder of its own under benchmarks/out/ (empty at start). Then for each page: a fresh
`streamlit run apps/streamlit_app.py -- --study STORE` (warm-up thread on, as `mismatch-lab app` runs it), a
fresh headless Chromium context (no cached assets), then

    first    the page's URL opened as the first page of the session, until the page shows its last
             element and Streamlit no longer runs the script (what a user who opens that page waits);
    reload   the same page reloaded (a new session on the same server: caches filled).

Each with the server's CPU seconds over that load (user + system, /proc/PID/stat): the machine is shared, so
wall seconds say more about the load than about the app. `--cold` also runs every page without any disk cache
(MISMATCH_LAB_CACHE=0: everything computed on first demand). Then one more server for a `tour`: every page in
turn in one session. Interactions (on by default, `--no-interactions` skips them; `--interactions-only` runs
them alone): on one server with the results cache filled by `--prepare`, per page a fresh browser context
loads the page once, then makes in turn what a user does there (INTERACTIONS: the pair, bucket controls,
category filters, sliders, the inspector's sequence, scorer and colour, the Corrections split, method and
threshold override, the buttons that open another page), the server idle (warm-up done) before each. Each is
timed from the widget's change (the Playwright click or key press; opening a drop-down or filling a form's
field is not timed) until the server has sent the script run's end (the websocket's ForwardMsg
`script_finished`) and the page shows its result (no stale element left, no "Running", every chart drawn,
the affected text shown), with the server's CPU seconds over the same span. The Training page's step picker
and the inspector's step list run on a Recorder's run of 200 steps (1 M tokens, written once under
benchmarks/out/app-steps-store). Printed as a table (page, interaction, wall s, server CPU s) and the slowest
per page; in the JSON under "interactions". `--reuse-cache` skips `--prepare` and keeps the last run's results
cache (what that run computed is then cached: for trying a selector, not for figures). Last, the `refresh` figure: a Recorder writes a run of M steps into a shard store, the
Training page (and the Overview: `--refresh-pages`; by default those of `--pages`) is loaded (every step computed), reloaded with no change (the fixed cost), N more steps are
written, the page is reloaded (only the new steps computed): wall and server CPU of the refresh against the full
load and the fixed cost, in the same run (that server runs without the warm-up thread, whose whole-store analyses
would count in its CPU).
Prints the CPU model and the load average; writes benchmarks/out/bench_app_browser.json. Needs
/usr/bin/chromium and Playwright (as tests/app/test_app_browser.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "out"
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
ACT_TIMEOUT_MS = 30_000  # an interaction that takes longer has failed
REPEATS = 5  # the refresh figure's reloads, each measured this many times (medians: a shared machine's load moves single ones)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def snapshot(rev: str) -> Path:
    """`apps/` and `mismatch_lab/` of commit `rev`, extracted under benchmarks/out/ (once): the code every server
    and `--prepare` of the run import (PYTHONPATH), so that edits in the working tree during the run neither
    change what is measured nor, through the results cache's key of the package's sources, empty the cache."""
    sha = subprocess.run(["git", "rev-parse", rev], check=True, capture_output=True, text=True, cwd=REPO).stdout.strip()
    dest = OUT / f"app-code-{sha[:12]}"
    if not (dest / "apps" / "streamlit_app.py").is_file():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha, "apps", "mismatch_lab"], check=True, capture_output=True,
                                 cwd=REPO).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat fields 14 and 15, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve(store: Path, log: Path, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    code = Path((env or {}).get("PYTHONPATH", REPO))  # run in the code's folder: `-m` puts the cwd first on sys.path
    app = code / "apps" / "streamlit_app.py"
    cmd = [sys.executable, "-m", "streamlit", "run", str(app), "--server.headless", "true", "--server.port",
           str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false",
           "--server.fileWatcherType", "none", "--", "--study", str(store)]
    with open(log, "ab") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=code,
                                env={**os.environ, "MISMATCH_LAB_APP_WARMUP": "1", **(env or {})})
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


def load(page, url: str, name: str, *, reload: bool = False, pid: int | None = None) -> tuple[float, float]:
    """(wall seconds, server CPU seconds) of one load of a page."""
    path, text = PAGES[name]
    c0, t0 = cpu_seconds(pid) if pid else 0.0, time.perf_counter()
    if reload:
        page.reload()
    else:
        page.goto(f"{url}/{path}")
    settle(page, text)
    return time.perf_counter() - t0, (cpu_seconds(pid) - c0 if pid else float("nan"))


def prepare(store: Path, env: dict) -> dict:
    """`mismatch-lab app --prepare` into the (empty) cache folder of `env`: wall and CPU seconds."""
    r0, t0 = os.times(), time.perf_counter()
    subprocess.run([str(Path(sys.executable).with_name("mismatch-lab")), "app", "--prepare", "--study", str(store)],
                   check=True, cwd=env.get("PYTHONPATH", REPO), env=dict(os.environ, **env), stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    r1 = os.times()
    return {"wall_s": time.perf_counter() - t0, "cpu_s": r1.children_user + r1.children_system
            - r0.children_user - r0.children_system}


def pages(browser, store: Path, names: list[str], log: Path, env: dict, label: str) -> dict:
    """Per page on a fresh server and browser context: the first load and a reload, wall and server CPU."""
    out = {}
    for name in names:
        proc, url = serve(store, log, env)
        try:
            page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            first, first_cpu = load(page, url, name, pid=proc.pid)
            again, again_cpu = load(page, url, name, reload=True, pid=proc.pid)
        finally:
            stop(proc)
        out[name] = {"first_s": first, "first_cpu_s": first_cpu, "reload_s": again, "reload_cpu_s": again_cpu}
        print(f"{label:8s} {name:12s} first {first:6.2f} s (server CPU {first_cpu:5.2f} s)   "
              f"reload {again:6.2f} s (CPU {again_cpu:5.2f} s)", flush=True)
    return out


def _log_steps(rec, steps: range, batch: int, length: int) -> None:
    import numpy as np

    for step in steps:
        rng = np.random.default_rng(step)
        lmu = -rng.exponential(1.0, (batch, length))
        lpi = np.minimum(lmu + rng.normal(0, 0.05, (batch, length)), 0.0)
        rec.log_step(step, rng.integers(0, 49_000, (batch, length)), np.ones((batch, length), bool), lmu, lpi,
                     rewards=rng.normal(size=batch))


REFRESHED = ("overview", "training")
"""The pages whose refresh on a store being written is measured (`refresh`) by default: those of `--pages` among
these (the pages computed per step; `--refresh-pages` names any page)."""


def refresh(browser, folder: Path, log: Path, env: dict, m: int, n: int, tokens: int, name: str = "training") -> dict:
    """The page `name` (REFRESHED) of a recorded run of m steps (`tokens` in all), reloaded with no new step (*fixed*: a new
    Streamlit session and the page drawn from the caches), after 1 new step and after n more. The target: a
    refresh after n steps of at most the fixed cost plus 2 n / m of the full load (issue 35, item 6); the 1-step
    refresh splits the rest into a cost per refresh (a connection over the new steps, each per-step query
    once) and a cost per new step. The three reloads are repeated REPEATS times on the same server (the run
    grows by n + 1 steps each time) and their medians reported: /proc counts CPU in 10 ms ticks."""
    import statistics

    from mismatch_lab.record import Recorder

    shutil.rmtree(folder, ignore_errors=True)
    batch, length = 16, max(1, tokens // (m * 16))
    with Recorder(folder, "live", framework="verl", rollout_engine="vllm", rollout_dtype="bf16") as rec:
        _log_steps(rec, range(m), batch, length)
        proc, url = serve(folder, log, env)
        try:
            page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            full, full_cpu = load(page, url, name, pid=proc.pid)
            loads, written = {0: [], 1: [], n: []}, m
            for _ in range(REPEATS):
                for k in (0, 1, n):
                    _log_steps(rec, range(written, written + k), batch, length)
                    written += k
                    time.sleep(1.0)  # past the page's fingerprint memo (lab_cache.FINGERPRINT_S)
                    loads[k].append(load(page, url, name, reload=True, pid=proc.pid))
        finally:
            stop(proc)
    (same, same_cpu), (one, one_cpu), (new, new_cpu) = (
        tuple(statistics.median(x[i] for x in loads[k]) for i in (0, 1)) for k in (0, 1, n))
    per_step = (new_cpu - one_cpu) / max(n - 1, 1)
    target = same_cpu + 2 * n / m * full_cpu
    out = {"page": name, "m_steps": m, "n_new": n, "tokens": m * batch * length, "full_s": full, "full_cpu_s": full_cpu,
           "fixed_s": same, "fixed_cpu_s": same_cpu, "one_s": one, "one_cpu_s": one_cpu, "refresh_s": new,
           "refresh_cpu_s": new_cpu, "ratio_wall": new / full, "ratio_cpu": new_cpu / full_cpu,
           "target_cpu_s": target, "per_new_step_cpu_s": per_step, "per_refresh_cpu_s": one_cpu - same_cpu - per_step}
    print(f"{name} refresh after {n} new steps of a run of {m} steps ({out['tokens']:,} tokens): {new:.2f} s "
          f"(server CPU {new_cpu:.2f} s) against a full load {full:.2f} s (CPU {full_cpu:.2f} s): ratio "
          f"{out['ratio_wall']:.2f} wall, {out['ratio_cpu']:.2f} CPU; a reload with no new step (fixed) {same:.2f} s "
          f"(CPU {same_cpu:.2f} s); target CPU <= fixed + 2 x {n}/{m} x full = {target:.2f} s: "
          f"{'met' if new_cpu <= target else 'NOT met'}. After 1 new step {one:.2f} s (CPU {one_cpu:.2f} s): "
          f"{out['per_refresh_cpu_s']:.3f} CPU s per refresh above the fixed cost, {per_step:.4f} per new step "
          f"(full load / {m}: {full_cpu / m:.4f})", flush=True)
    return out


# ---- interactions on a warm server ---------------------------------------------------------------------------
# A Streamlit script run has ended when the server sends a ForwardMsg `script_finished` with one of these
# statuses (FINISHED_SUCCESSFULLY, FINISHED_FRAGMENT_RUN_SUCCESSFULLY; not FINISHED_EARLY_FOR_RERUN: a run that a
# rerun replaced, as st.switch_page does before the new page's run).
FINISHED = (0, 3)
# ... and its result is on screen when no element of the previous run is left stale, the status widget no
# longer says "Running", every chart has been drawn (vega-embed adds its canvas or svg) and the element the change
# affects (a text it draws; the page's last section by default) is shown.
SHOWN = """(text) => {
  const status = document.querySelector('[data-testid="stStatusWidget"]');
  if (status && status.innerText.includes('Running')) return false;
  if (document.querySelector('[data-testid="stElementContainer"][data-stale="true"]')) return false;
  for (const chart of document.querySelectorAll('[data-testid="stVegaLiteChart"]'))
    if (!chart.querySelector('canvas, svg')) return false;
  return document.body.innerText.includes(text);
}"""
QUIET_CPU_S = 0.02  # the server counts as idle (warm-up done) once it spends at most this much CPU in QUIET_S
QUIET_S = 0.5


def widget(page, testid: str, label: str):
    """The first visible widget of a kind (its data-testid) whose text holds `label`."""
    return page.get_by_test_id(testid).filter(has_text=label).filter(visible=True).first


def option(page, index: int):
    return page.get_by_role("option").filter(visible=True).nth(index)


class Act:
    """One interaction: `ready` (not timed: open a drop-down, fill a form's field), then `change` (timed: the
    click or key press that sets the widget's new value), then the wait until `shows` is on screen."""

    def __init__(self, name: str, change, ready=None, shows: str | None = None):
        self.name, self.change, self.ready, self.shows = name, change, ready, shows


def pick(name: str, label: str, index: int, shows: str | None = None) -> Act:
    """Choose the option at `index` of a select box."""
    def ready(p):
        box = widget(p, "stSelectbox", label)
        box.scroll_into_view_if_needed()  # (a box opened below the fold showed no options)
        box.get_by_label("Open").click()
        option(p, index).wait_for()

    return Act(name, lambda p: option(p, index).click(), ready=ready, shows=shows)


def radio(name: str, label: str, choice: str, shows: str | None = None) -> Act:
    return Act(name, lambda p: widget(p, "stRadio", label).get_by_text(choice, exact=True).click(), shows=shows)


def untag(name: str, label: str, tag: str, shows: str | None = None) -> Act:
    """Remove one chosen value of a multiselect (its tag's cross)."""
    return Act(name, lambda p: widget(p, "stMultiSelect", label).get_by_label(f"Remove {tag}").click(), shows=shows)


def add_tag(name: str, label: str, text: str, shows: str | None = None) -> Act:
    """Add a value to a multiselect: its text typed (not timed), then Enter."""
    def ready(p):
        widget(p, "stMultiSelect", label).locator("input").click()
        p.keyboard.type(text)
        option(p, 0).wait_for()

    return Act(name, lambda p: p.keyboard.press("Enter"), ready=ready, shows=shows)


def key(name: str, label: str, press: str, shows: str | None = None) -> Act:
    """One key on a slider's thumb (the value moves one step; Streamlit sends it after its 200 ms debounce)."""
    return Act(name, lambda p: p.keyboard.press(press), shows=shows,
               ready=lambda p: widget(p, "stSlider", label).locator("input[type=range]").focus())


def apply(name: str, fill, shows: str | None = None) -> Act:
    """Set a form's fields (not timed: a form sends nothing before its submit), then click its Apply button."""
    return Act(name, lambda p: widget(p, "stFormSubmitButton", "Apply").click(), ready=fill, shows=shows)


def press(name: str, button: str, shows: str | None = None) -> Act:
    return Act(name, lambda p: p.get_by_role("button", name=button).filter(visible=True).first.click(), shows=shows)


def _fill(label: str, value: str, testid: str = "stNumberInput"):
    return lambda p: widget(p, testid, label).locator("input").fill(value)


def _slider_keys(label: str, *keys: str):
    def ready(p):
        widget(p, "stSlider", label).locator("input[type=range]").focus()
        for k in keys:
            p.keyboard.press(k)

    return ready


def _overrides(text: str):
    def ready(p):
        if not widget(p, "stTextInput", "Overrides").is_visible():
            widget(p, "stExpander", "Threshold overrides").locator("summary").click()
        _fill("Overrides", text, "stTextInput")(p)

    return ready


# page -> what a user does there, in order, in one session after the page's first load (the benchmark study:
# bench_app.py's)
INTERACTIONS = {
    "overview": [press("reload data (sidebar button: memory caches emptied)", "Reload data", "Precision table")],
    "volatility": [
        pick("pair: second", "Pair (rollout", 1),
        apply("μ buckets: log (Apply)", lambda p: widget(p, "stRadio", "μ buckets").get_by_text("log").click()),
        apply("buckets: 10 (Apply)", _slider_keys("Buckets", "Home", *["ArrowRight"] * 5)),
        apply("ε low 0.1 (Apply)", _fill("ε low", "0.10"), shows="[1 − 0.1, 1 +"),
        pick("pair: first", "Pair (rollout", 0),
    ],
    "clipping": [
        pick("pair: second", "Pair (rollout", 1),
        untag("categories: drop number", "Token categories", "number"),
        add_tag("categories: add number back", "Token categories", "number"),
        radio("tokens: positive advantage", "Tokens", "positive advantage"),
        key("top tokens slider: +1", "How many token strings", "ArrowRight"),
    ],
    "corrections": [
        pick("pair: second", "Pair (rollout", 1),
        radio("tokens: by category", "Tokens", "token categories", shows="Token categories"),
        untag("categories: drop number", "Token categories", "number"),
        radio("tokens: advantage sign", "Tokens", "advantage sign", shows="Advantage sign"),
        radio("tokens: all", "Tokens", "all tokens of the pair"),
        pick("dropping method: second", "Method", 1),
        pick("dropped sequence: second", "Sequence", 1),
        apply("threshold override seq_mis.cap=2 (Apply)", _overrides("seq_mis.cap=2"), shows="Overrides applied"),
        apply("threshold override cleared (Apply)", _overrides("")),
        press("open the sequence in the inspector (button)", "in the token inspector", "Cumulative log-ratio"),
    ],
    "inspector": [
        pick("sequence: second", "Sequence", 1),
        radio("colour by ratio", "Colour tokens by", "ratio"),
        radio("colour by mask decision", "Colour tokens by", "mask decision"),
        pick("token: another", "Token (defaults", 2),
        pick("scorer: second", "Scorer (π)", 1),
        pick("run: second", "Run", 1),
        radio("worst sequences", "Pick a sequence", "Worst sequences by max |Δp|", shows="Worst 50 sequences"),
        pick("worst under another scorer", "|Δp| under scorer", 1),
        pick("worst: second sequence", "Worst 50 sequences", 1),
    ],
    "training": [add_tag("metrics: add actor/pg_clipfrac (a 2,000-step curve)", "Metrics (slash", "actor/pg")],
    "figures": [],  # (the page has no widget: it draws the study's figures)
}
RECORDED = {  # on the recorded run of steps_store(): the step pickers
    "training": [
        add_tag("per-step metric: add |Δlogp|", "Per-step metrics", "|log π"),
        key("step slider: one back", "Step", "ArrowLeft"),
        press("open the step in the inspector (button)", "in the token inspector", "Cumulative log-ratio"),
        pick("inspector: another training step", "Training step", 2, "Cumulative log-ratio"),
    ],
}


def _finished(payload) -> bool:
    """Whether a websocket frame from the server is the end of a script run (FINISHED)."""
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

    if isinstance(payload, str):
        return False
    msg = ForwardMsg.FromString(payload)
    return msg.WhichOneof("type") == "script_finished" and msg.script_finished in FINISHED


def quiet(pid: int, limit_s: float = 120.0) -> None:
    """Wait (at most limit_s) until the server is idle: its warm-up done, no script running."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        c0 = cpu_seconds(pid)
        time.sleep(QUIET_S)
        if cpu_seconds(pid) - c0 <= QUIET_CPU_S:
            return


def timed(page, socket, pid: int, act: Act, default: str) -> tuple[float, float]:
    """(wall s, server CPU s) from the change until its script run has ended and its result is on screen."""
    c0, t0 = cpu_seconds(pid), time.perf_counter()
    with socket.expect_event("framereceived", predicate=_finished, timeout=ACT_TIMEOUT_MS):
        act.change(page)
    page.wait_for_function(SHOWN, arg=act.shows or default, timeout=ACT_TIMEOUT_MS, polling="raf")
    wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - c0
    boxes = page.locator('[data-testid="stException"]')
    if boxes.count():
        raise SystemExit(f"{act.name}: the page raised: {boxes.first.inner_text()[:1000]}")
    return wall, cpu


def interactions(browser, store: Path, log: Path, env: dict, plan: dict[str, list[Act]], label: str) -> list[dict]:
    """On one server (results cache of `env`), per page of `plan`: its interactions (`page_interactions`)."""
    rows = []
    proc, url = serve(store, log, env)
    try:
        for name, acts in plan.items():
            rows += [{"store": label, "page": name, **row} for row in page_interactions(browser, url, proc.pid, name,
                                                                                          acts)]
    finally:
        stop(proc)
    return rows


def page_interactions(browser, url: str, pid: int, name: str, acts: list[Act]) -> list[dict]:
    """A fresh browser context, the page's first load (not timed here), then each interaction in turn, timed,
    the server idle before each."""
    if not acts:
        return []
    rows, sockets = [], []
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.on("websocket", lambda ws: sockets.append(ws))
    load(page, url, name)
    for act in acts:
        quiet(pid)
        if act.ready:
            act.ready(page)
        wall, cpu = timed(page, sockets[-1], pid, act, PAGES[name][1])
        rows.append({"interaction": act.name, "wall_s": wall, "server_cpu_s": cpu})
        print(f"interaction {name:12s} {act.name:55s} {wall:6.2f} s (server CPU {cpu:5.2f} s)", flush=True)
    context.close()
    return rows


def steps_store(folder: Path, m: int = 200, tokens: int = 1_000_000) -> Path:
    """A Recorder's run of m steps (`tokens` in all, as the refresh figure's) in a shard store: the Training
    page's step picker and the inspector's step list need sequences that carry a step. Written once, kept."""
    from mismatch_lab.record import Recorder

    done = folder.with_name(folder.name + ".complete")
    if not done.exists():
        shutil.rmtree(folder, ignore_errors=True)
        t0 = time.perf_counter()
        with Recorder(folder, "recorded", framework="verl", rollout_engine="vllm", rollout_dtype="bf16") as rec:
            _log_steps(rec, range(m), 16, max(1, tokens // (m * 16)))
        done.touch()
        print(f"recorded run of {m} steps written to {folder} in {time.perf_counter() - t0:.1f} s", flush=True)
    return folder


def print_interactions(rows: list[dict]) -> None:
    print(f"\n{'page':12s} {'interaction':70s} {'wall s':>7s} {'server CPU s':>13s}")
    for r in rows:
        where = "" if r["store"] == "study" else f" ({r['store']})"
        print(f"{r['page']:12s} {r['interaction'] + where:70s} {r['wall_s']:7.2f} {r['server_cpu_s']:13.2f}")
    for page in dict.fromkeys(r["page"] for r in rows):
        worst = max((r for r in rows if r["page"] == page), key=lambda r: r["wall_s"])
        print(f"slowest on {page}: {worst['interaction']} {worst['wall_s']:.2f} s (server CPU "
              f"{worst['server_cpu_s']:.2f} s)")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def tour(browser, store: Path, log: Path, env: dict) -> dict:
    """Every page in turn in one session of one server: (wall s, server CPU s) of each load."""
    out = {}
    proc, url = serve(store, log, env)
    try:
        page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
        for name in PAGES:
            out[name] = load(page, url, name, pid=proc.pid)
            print(f"tour {name:12s} {out[name][0]:6.2f} s (CPU {out[name][1]:5.2f} s)", flush=True)
    finally:
        stop(proc)
    return out


def run_interactions(browser, store: Path, names: list[str], log: Path, env: dict) -> list[dict]:
    """INTERACTIONS of the chosen pages on the study, then RECORDED's on the recorded run of steps_store()."""
    rows = interactions(browser, store, log, env, {n: INTERACTIONS[n] for n in names}, "study")
    recorded = {n: acts for n, acts in RECORDED.items() if n in names}
    if recorded:
        rows += interactions(browser, steps_store(OUT / "app-steps-store"), log, env, recorded, "recorded run")
    print_interactions(rows)
    return rows


def measure(browser, args, log: Path, cached: dict) -> dict:
    """What the options ask for, in this order: first loads, interactions, cold first loads, tour, refresh."""
    report = {}
    if not args.interactions_only:
        report["pages"] = pages(browser, args.store, args.pages, log, cached, "cached")
    if not args.no_interactions:
        report["interactions"] = run_interactions(browser, args.store, args.pages, log, cached)
    if args.interactions_only:
        return report
    if args.cold:
        report["cold"] = pages(browser, args.store, args.pages, log, {**cached, "MISMATCH_LAB_CACHE": "0"}, "cold")
    if not args.no_tour:
        report["tour"] = tour(browser, args.store, log, cached)
    for name in (args.refresh_pages or [p for p in args.pages if p in REFRESHED]) if args.refresh[0] else ():
        # warm-up off: its whole-store analyses in the background would be counted in the server's CPU
        key = "refresh" if name == "training" else f"refresh_{name}"
        report[key] = refresh(browser, OUT / "app-live-store", log, cached | {"MISMATCH_LAB_APP_WARMUP": "0"},
                              *args.refresh, tokens=args.refresh_tokens, name=name)
    return report


def main(argv: list[str] | None = None) -> int:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", type=Path, default=OUT / "app-1000000", help="the study (bench_app.py builds it)")
    parser.add_argument("--pages", nargs="+", choices=list(PAGES), default=list(PAGES))
    parser.add_argument("--no-tour", action="store_true")
    parser.add_argument("--cold", action="store_true", help="also every page without a disk cache")
    parser.add_argument("--no-interactions", action="store_true", help="skip the interactions")
    parser.add_argument("--interactions-only", action="store_true",
                        help="only the interactions (after --prepare): no first loads, tour or refresh")
    parser.add_argument("--reuse-cache", action="store_true",
                        help="keep the results cache of the last run (no --prepare: only for the same commit)")
    parser.add_argument("--commit", default="HEAD", help="the commit whose apps/ and mismatch_lab/ are measured")
    parser.add_argument("--refresh", nargs=2, type=int, default=[200, 5], metavar=("M", "N"),
                        help="the refresh figure: a run of M steps, then N new ones (0 0: skip)")
    parser.add_argument("--refresh-tokens", type=int, default=1_000_000, metavar="T",
                        help="the refresh figure's run holds about T tokens (16 sequences a step; the same tokens a "
                             "step at M steps and T x M'/M at M': a longer run of the same steps)")
    parser.add_argument("--refresh-pages", nargs="+", choices=list(PAGES),
                        help="the pages whose refresh is measured (default: Overview and Training among --pages; any page)")
    args = parser.parse_args(argv)
    if not args.store.exists():
        raise SystemExit(f"{args.store} missing: run benchmarks/bench_app.py once to build it")
    OUT.mkdir(parents=True, exist_ok=True)
    log = OUT / "bench_app_browser.log"
    log.write_bytes(b"")
    code = snapshot(args.commit)
    print(f"code: {args.commit} extracted to {code}", flush=True)
    cached = {"MISMATCH_LAB_CACHE": str(OUT / "app-results-cache"), "PYTHONPATH": str(code)}
    load0, report = os.getloadavg(), {}
    report["commit"] = code.name.removeprefix("app-code-")
    if not args.reuse_cache:
        shutil.rmtree(cached["MISMATCH_LAB_CACHE"], ignore_errors=True)
        report["prepare"] = prepare(args.store, cached)
        print(f"prepare: {report['prepare']['wall_s']:.1f} s, CPU {report['prepare']['cpu_s']:.1f} s", flush=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        report |= measure(browser, args, log, cached)
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
