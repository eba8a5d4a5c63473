"""`mismatch-lab figures`: regenerate the figures of stored studies into `<study>/figures/` (PNG and PDF).

    mismatch-lab figures studies/precision-sweep              one study (its results/ Parquet)
    mismatch-lab figures --all                                 every studies/*/ that has results/
    mismatch-lab figures studies/x --only 1 3 --format png     a subset

A study is read through `open_store` (a study directory, a results/ directory or a .duckdb file); the
figures go to `<study>/figures/` (for a .duckdb file: `figures/` beside it), or to `--out`. A figure whose
data the study lacks is skipped with a printed note, never drawn empty.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from mismatch_lab.errors import UserError

FORMATS = ("png", "pdf")
DPI = 110


def _metadata(fmt: str) -> dict:
    """File metadata without a creation date, so regenerating unchanged data gives byte-identical files."""
    if fmt == "pdf":
        return {"Creator": "mismatch-lab figures", "CreationDate": None}
    return {"Creator": "mismatch-lab figures"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("studies", nargs="*", help="study directories (studies/<name>), results/ directories, "
                        ".duckdb files or recorded/imported run stores")
    parser.add_argument("--all", action="store_true", help="every <root>/*/ holding a results/ folder")
    parser.add_argument("--root", default="studies", help="where --all looks (default: studies)")
    parser.add_argument("--only", nargs="+", metavar="N", help="figure numbers to draw (default: all, 1-9)")
    parser.add_argument("--format", nargs="+", default=list(FORMATS), choices=FORMATS, help="output formats")
    parser.add_argument("--out", help="output directory (only with a single study; default <study>/figures)")


def study_dirs(root: str | Path) -> list[Path]:
    """The studies under root that hold stored results."""
    return sorted(p for p in Path(root).iterdir() if p.is_dir() and (p / "results").is_dir())


def out_dir_for(study: Path) -> Path:
    if study.is_file():  # a .duckdb file or study.toml
        return study.parent / "figures"
    if study.name == "results" and not (study / "results").is_dir():
        return study.parent / "figures"
    return study / "figures"


def draw_study(study: str | Path, out: str | Path | None = None, *, only=None, formats=FORMATS,
               log=print) -> dict[str, list[Path]]:
    """Draw every figure (or `only` those numbers) of one study; returns stem -> written files. Figures
    whose data is absent are skipped with a note through `log`."""
    from mismatch_lab.figures.base import Skip, study_rows
    from mismatch_lab.figures.figures import FIGURES
    from mismatch_lab.store.reader import open_store

    study = Path(study)
    out = Path(out) if out else out_dir_for(study)
    con = open_store(study)
    written: dict[str, list[Path]] = {}
    rows = None
    try:
        out.mkdir(parents=True, exist_ok=True)
        try:
            rows = study_rows(con)  # the collect runs joined once, shared by figures 1-5
        except Skip:
            rows = None  # no collect runs: figures 1-5 say so themselves
        for num, fn in FIGURES.items():
            if only and num not in only:
                continue
            t0 = time.perf_counter()
            try:
                figs = fn(con, rows)
            except Skip as exc:
                log(f"  figure {num} skipped: {exc}")
                continue
            for stem, fig in figs:
                paths = []
                for fmt in formats:
                    path = out / f"{stem}.{fmt}"
                    fig.savefig(path, dpi=DPI, metadata=_metadata(fmt))
                    paths.append(path)
                written[stem] = paths
            log(f"  figure {num}: {', '.join(s for s, _ in figs)} ({time.perf_counter() - t0:.1f} s)")
    finally:
        if rows is not None:
            rows.close()
        con.close()
    return written


def run(args: argparse.Namespace) -> int:
    studies = [Path(s) for s in args.studies]
    if args.all:
        root = Path(args.root)
        if not root.is_dir():
            raise UserError(f"--root {root} is not a directory")
        studies += [s for s in study_dirs(root) if s not in studies]
    if not studies:
        raise UserError("name a study (mismatch-lab figures studies/<name>) or pass --all")
    if args.out and len(studies) > 1:
        raise UserError("--out takes a single study")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UserError(f"--out {args.out} exists and is not a directory; pass a new or existing folder")
    from mismatch_lab.figures.figures import FIGURES

    unknown = sorted(set(args.only or ()) - set(FIGURES))
    if unknown:
        raise UserError(f"--only {' '.join(unknown)}: no such figure; the figures are {', '.join(FIGURES)}")
    only = set(args.only) if args.only else None
    t_all = time.perf_counter()
    for study in studies:
        t0 = time.perf_counter()
        print(f"{study}:", flush=True)
        written = draw_study(study, args.out, only=only, formats=args.format,
                             log=lambda m: print(m, flush=True))
        n_files = sum(len(v) for v in written.values())
        print(f"  {len(written)} figures, {n_files} files -> {Path(args.out) if args.out else out_dir_for(study)} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"done: {len(studies)} studies in {time.perf_counter() - t_all:.1f} s")
    return 0
