"""Paths shared by the app tests."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "apps" / "streamlit_app.py"
