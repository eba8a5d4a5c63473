"""What a user sees: our progress bar, the memory plan and the summary. The engines' own logs, loading bars
and library warnings are shown with `--verbose` (or each library's own variable, which wins when set)."""

from __future__ import annotations

import logging
import os
import warnings


def quiet_libraries(verbose: bool) -> None:
    """Hide the engines' logs for this process unless `verbose` (call before the libraries load)."""
    if verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # per-call CPU-backend notices, start-up config
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # C++ warnings (NUMA binding); read when torch loads
    for name in ("torch", "transformers", "vllm"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for module in (r"vllm(\..*)?", r"torch(\..*)?", r"transformers(\..*)?"):
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=module)
    import transformers

    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars of every model load
    transformers.utils.logging.set_verbosity_error()
