"""Paths and the page opener shared by the app tests."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "apps" / "streamlit_app.py"


def open_page(store, monkeypatch, page: str):
    """The app (AppTest) on `store`, switched to `app_pages/<page>.py`, with no exception raised."""
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("MISMATCH_LAB_STUDY", str(store))
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.run()
    at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, at.exception
    return at
