"""Select boxes over positions in a list that changes under them (another pair, method, scorer or overrides).

Streamlit sends a select box's value from the browser as the option's label, so a position kept while its
list changed shows one item and acts on another at the next interaction: the Corrections page's sequence
moved, and the click on its *Open ... in the token inspector* button (labelled by the sequence) was lost
(benchmarks/bench_app_browser.py's interactions found it). `follow` moves the remembered position with its item.
"""

import streamlit as st


def follow(key: str, ids: list) -> None:
    """Before the select box `key` over positions of `ids` (hashable identities of its options, in order):
    when `ids` differs from the last run's, move the remembered position to its item's new one, or to the first
    option when the item is gone."""
    seen = st.session_state.get(f"{key}:ids")
    st.session_state[f"{key}:ids"] = ids
    if seen is None or seen == ids or key not in st.session_state:
        return
    at = st.session_state[key]
    item = seen[at] if isinstance(at, int) and 0 <= at < len(seen) else None
    if item is not None and item in ids:
        st.session_state[key] = ids.index(item)
    elif ids:  # set, not deleted: the browser keeps the label it last sent and would send it again
        st.session_state[key] = 0
    else:
        del st.session_state[key]
