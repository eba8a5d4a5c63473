"""The app's line charts keep lines apart: past ten series the colour scheme has twenty colours."""

from __future__ import annotations

import pandas as pd
import pytest


class _Sink:
    def altair_chart(self, chart, **_):
        self.spec = chart.to_dict()


@pytest.mark.parametrize(("n_runs", "scheme"), [(3, "tableau10"), (10, "tableau10"), (11, "tableau20")])
def test_the_colour_scheme_has_a_colour_per_run(lab_ui, n_runs, scheme):
    data = pd.DataFrame([{"step": s, "value": 0.1 * s + r, "run": f"run {r}"} for r in range(n_runs) for s in range(3)])
    sink = _Sink()
    lab_ui.line_chart(data, "step", "value", "run", x_title="step", y_title="value", where=sink)
    assert sink.spec["encoding"]["color"]["scale"]["scheme"] == scheme
    assert sink.spec["encoding"]["color"]["field"] == "run"
