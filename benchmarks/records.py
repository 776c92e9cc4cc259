"""docs/benchmarks.md from the benchmarks' records: each script's latest run, with its host.

Every benchmark appends each record it prints to ``benchmarks/records/<script>.jsonl``, filed
under its run (script, arguments, commit, date, CPU, one-thread fp32 and bf16 matmul peaks;
benchmarks/_host.py). This writes the page from those files alone, so that no figure on it is
typed by hand; ``tests/e2e/test_docs.py`` checks that the committed page is what this writes.

    python benchmarks/records.py            # rewrite docs/benchmarks.md
    python benchmarks/records.py --check    # exit 1 where the page is not what the records give
"""

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
RECORDS = ROOT / "records"
PAGE = ROOT.parent / "docs" / "benchmarks.md"

INTRO = """# Benchmarks

Written by `python benchmarks/records.py` from `benchmarks/records/*.jsonl`; do not edit. Each
script prints one JSON object per line, most of them a ratio of two measurements taken side by
side in one process (medians of interleaved repeats), so that machine noise hits both sides, and
every line carries the host's one-thread bf16 matmul peak: a timing compares with another
host's only beside it. Below, each script's purpose (its docstring) and its latest recorded run;
earlier runs stay in the records file and in git.
"""


def purpose(script: Path) -> str:
    """The first paragraph of a script's docstring, read without importing it (torch)."""
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())


def runs(path: Path) -> list[tuple[dict, list[dict]]]:
    """The runs of a records file, in the order they were appended, each with its records."""
    grouped: dict[str, tuple[dict, list[dict]]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            key = json.dumps(entry["run"], sort_keys=True)
            grouped.setdefault(key, (entry["run"], []))[1].append(entry["record"])
    return list(grouped.values())


def _value(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, dict)):
        text = json.dumps(v, separators=(",", ":"))
        return text if len(text) <= 60 else text[:57] + "..."
    return str(v)


def _row(record: dict) -> str:
    fields = ", ".join(f"{k} {_value(v)}" for k, v in record.items() if k not in ("name", "host_bf16_peak_gflops"))
    return f"| {record.get('name', '')} | {fields.replace('|', '/')} |"


def render() -> str:
    parts = [INTRO]
    for script in sorted(p for p in ROOT.glob("*.py") if not p.name.startswith("_") and p.name != "records.py"):
        parts.append(f"## `benchmarks/{script.name}`\n\n{purpose(script)}\n")
        path = RECORDS / f"{script.stem}.jsonl"
        found = runs(path) if path.exists() else []
        if not found:
            parts.append(f"No recorded run yet: `python benchmarks/{script.name}`.\n")
            continue
        run, records = found[-1]
        args = " ".join(run["argv"]) or "(no arguments)"
        parts.append(
            f"Latest run: `{args}` at `{run['commit'][:10]}`{' (uncommitted changes)' if run['dirty'] else ''}, "
            f"{run['date']}, on {run['cpu_model']} ({run['cpus']} CPUs, {', '.join(run['cpu_flags']) or 'no AVX2'}; "
            f"one-thread matmul peak fp32 {run['host_fp32_peak_gflops']:g}, bf16 {run['host_bf16_peak_gflops']:g} "
            f"GFLOP/s); {len(found)} run(s) recorded.\n"
        )
        parts.append("| record | figures |\n| --- | --- |\n" + "\n".join(_row(r) for r in records) + "\n")
    return "\n".join(parts)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            sys.exit(f"{PAGE} is not what benchmarks/records/ gives: run python benchmarks/records.py")
        return
    PAGE.write_text(page)


if __name__ == "__main__":
    main()
