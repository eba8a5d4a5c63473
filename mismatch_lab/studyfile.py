"""Reading `studies/<name>/study.toml`: one table of settings applied over a config dataclass.

Shared by `collect` ([collect] table, or top-level keys) and `train` ([train] table). Keys may use '-'
or '_'; unknown keys and malformed TOML are user errors; the listed path keys are resolved relative to
the study file; the study name and default database come from the study's folder.

Every value is checked for its type once, here, against a schema (key -> `Kind`) derived from the config
dataclass's field annotations (`KINDS`; path keys are `PATH`): a value of the wrong type is a UserError
naming the file, the key, the value's TOML type, the expected type and an example (the field's default),
before anything else reads it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import tomllib

from mismatch_lab.errors import UserError


@dataclass(frozen=True)
class Kind:
    """What a study-file key holds: `expected` (for the error), `accepts` (the check) and `example` (a
    TOML value of that kind, used where the field's default is no example)."""

    expected: str
    accepts: Callable[[object], bool]
    example: str


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


INTEGER = Kind("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool), "4")
NUMBER = Kind("a number", _number, "0.5")
NUMBER_OR_NONE = Kind('a number or "none"', lambda v: _number(v) or (isinstance(v, str) and v.lower() in ("none", "")),
                      "0.2")
TEXT = Kind("a string", lambda v: isinstance(v, str), '"..."')
PATH = Kind("a path (a string)", lambda v: isinstance(v, str), '"prompts.jsonl"')
BOOLEAN = Kind("true or false", lambda v: isinstance(v, bool), "true")
TEXT_LIST = Kind("an array of strings (or one comma-separated string)",
                 lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
                 '["bf16", "fp32"]')

KINDS: dict[str, Kind] = {"int": INTEGER, "float": NUMBER, "float | None": NUMBER_OR_NONE, "str": TEXT,
                          "bool": BOOLEAN, "list": TEXT_LIST}
"""A config field's annotation -> the Kind of its study-file value."""

TOML_TYPES = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array",
              dict: "a table"}
"""How the error names the type of the value found (TOML's words; dates: their Python name)."""


@dataclass(frozen=True)
class Field:
    """One key of a study table: its Kind and the example the error shows (`key = <example>`)."""

    kind: Kind
    example: str


def toml_value(v) -> str | None:
    """`v` written as a TOML value (None for what is no example: None, '' or an empty list)."""
    if v is None or v == "" or v == []:
        return None
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) or '""' for x in v) + "]"
    return None


def study_schema(config_cls, path_keys: tuple[str, ...] = (), examples: dict[str, str] | None = None) -> dict[str, Field]:
    """key -> Field of every field of the dataclass `config_cls`: the Kind of its annotation (`KINDS`;
    `PATH` for `path_keys`) and its default as the example (`examples`: key -> TOML value, where the
    default is none). TypeError for an annotation without a Kind."""
    examples = examples or {}
    schema = {}
    for f in fields(config_cls):
        kind = PATH if f.name in path_keys else KINDS.get(f.type if isinstance(f.type, str) else f.type.__name__)
        if kind is None:
            raise TypeError(f"{config_cls.__name__}.{f.name}: no study-file Kind for the annotation {f.type!r}")
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        example = toml_value(default) if default is not MISSING else None
        if f.name in examples or example is None or not kind.accepts(default):
            example = examples.get(f.name, kind.example)
        schema[f.name] = Field(kind, example)
    return schema


def check_types(path: Path, where: str, data: dict, schema: dict[str, Field]) -> None:
    """UserError at the first key of `data` whose value is not of its schema Kind (module docstring);
    `where` names the table ('[collect] ', or '' for top-level keys)."""
    for key, value in data.items():
        field = schema[key]
        if not field.kind.accepts(value):
            found = TOML_TYPES.get(type(value), type(value).__name__)
            raise UserError(f"{path}: {where}{key} = {toml_value(value) or repr(value):.60} is {found}; expected "
                            f"{field.kind.expected}, e.g. {key} = {field.example}")


def apply_study(cfg, study_arg: str, table: str, names: set[str], *, path_keys: tuple[str, ...],
                required: bool = False, schema: dict[str, Field] | None = None) -> Path:
    """Set the fields of `cfg` from table `table` of the study file; returns the study file's path. Values
    are checked against `schema` (default: `study_schema(type(cfg), path_keys)`) before any is used."""
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
    where = f"[{table}] " if isinstance(data.get(table), dict) else ""
    if where:
        data = data[table]
    else:  # top-level keys; other tables ([train] beside them) are not this command's
        data = {k: v for k, v in data.items() if not (isinstance(v, dict) and k.replace("-", "_") not in names)}
    data = {k.replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - names)
    if unknown:
        raise UserError(f"{path}: unknown keys {unknown} in [{table}]; valid keys are {sorted(names)}")
    check_types(path, where, data, schema or study_schema(type(cfg), path_keys))
    cfg.study = path.parent.name
    cfg.db = str(path.parent / f"{path.parent.name}.duckdb")
    for k, v in data.items():
        if k in path_keys or (k == "model" and v.startswith((".", "/"))):
            v = str((path.parent / v).resolve()) if not Path(v).is_absolute() else v
        setattr(cfg, k, v)
    return path
