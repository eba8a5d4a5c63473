"""mismatch_lab app: browse a study's training-inference mismatch down to a single token.

    mismatch-lab app --study studies/precision-sweep          # the usual way
    streamlit run apps/streamlit_app.py -- --study studies/precision-sweep

`--study` takes a study folder (reads its `results/` Parquet), a `.duckdb` file (read-only; a snapshot
when a writer holds it, so a running collect is never blocked) or a folder of Parquet files. Without
it the sidebar offers every study under `studies/`. Pages hold UI only; queries come from
`mismatch_lab.analysis` through the caches of `apps/lab_ui.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

APP_DIR = Path(__file__).resolve().parent
if str(APP_DIR) not in sys.path:  # `streamlit run` adds it; AppTest and other runners may not
    sys.path.insert(0, str(APP_DIR))

import lab_inspect
import lab_ui
import streamlit as st
from streamlit import config as st_config

st.set_page_config(page_title="mismatch_lab", page_icon=":material/biotech:", layout="wide")
if st_config.get_option("runner.postScriptGC"):  # Streamlit's full collection after every script run: with the
    # warm-up's torch imported ~0.24 server CPU s of each interaction, twice on a page switch (docs/app.md); Python's
    # own generational collection still runs. Not settable through `st.set_option`, hence the config module.
    st_config.set_option("runner.postScriptGC", False)

PAGES = {
    "Study": [
        st.Page("app_pages/overview.py", title="Overview", icon=":material/table_chart:", default=True),
        st.Page("app_pages/volatility.py", title="Volatility", icon=":material/show_chart:"),
        st.Page("app_pages/clipping.py", title="Clipping", icon=":material/content_cut:"),
        st.Page("app_pages/corrections.py", title="Corrections", icon=":material/rule:"),
        st.Page("app_pages/routing.py", title="Routing", icon=":material/alt_route:"),
    ],
    "Tokens and training": [
        st.Page("app_pages/inspector.py", title="Token inspector", icon=":material/manage_search:"),
        st.Page("app_pages/training.py", title="Training", icon=":material/model_training:"),
        st.Page("app_pages/figures.py", title="Figures", icon=":material/image:"),
    ],
}

page = st.navigation(PAGES)
first_load = "app_loaded" not in st.session_state  # the session's first run: its first page load
st.session_state["app_loaded"] = True
with lab_ui.page_run(first_load):  # the warm-up's quiet wait counts from a first load's start and end
    lab_inspect.switch_if_asked()  # a button's click that opens the token inspector: before any page runs again
    lab_ui.sidebar_store_picker()
    page.run()
