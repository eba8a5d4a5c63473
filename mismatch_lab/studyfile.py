"""Reading `studies/<name>/study.toml`: one table of settings applied over a config dataclass.

Shared by `collect` ([collect] table, or top-level keys) and `train` ([train] table). Keys may use '-'
or '_'; unknown keys and malformed TOML are user errors; the listed path keys are resolved relative to
the study file; the study name and default database come from the study's folder.
"""

from __future__ import annotations

from pathlib import Path

import tomllib

from mismatch_lab.errors import UserError


def apply_study(cfg, study_arg: str, table: str, names: set[str], *, path_keys: tuple[str, ...],
                required: bool = False) -> Path:
    """Set the fields of `cfg` from table `table` of the study file; returns the study file's path."""
    path = Path(study_arg)
    if path.is_dir():
        path = path / "study.toml"
    if not path.is_file():
        raise UserError(f"--study {study_arg}: no such file; pass studies/<name>/study.toml")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: malformed TOML ({exc}); fix the study file") from exc
    if required and table not in data:
        raise UserError(f"{path}: no [{table}] table; add one with the {table} keys (see README)")
    data = data.get(table, data)
    data = {k.replace("-", "_"): v for k, v in data.items() if not isinstance(v, dict)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise UserError(f"{path}: unknown keys {unknown} in [{table}]; valid keys are {sorted(names)}")
    cfg.study = path.parent.name
    cfg.db = str(path.parent / f"{path.parent.name}.duckdb")
    for k, v in data.items():
        if k in path_keys or (k == "model" and str(v).startswith((".", "/"))):
            v = str((path.parent / v).resolve()) if not Path(v).is_absolute() else v
        setattr(cfg, k, v)
    return path
