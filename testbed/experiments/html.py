"""Self-contained HTML pages for `testbed report`: tables as HTML tables,
figures embedded as base64 PNG, one file that opens anywhere (a browser, a
W&B artifact, an e-mail) with nothing beside it. Pure string building; the
report (testbed/report.py) decides what goes on a page."""
from __future__ import annotations

import base64
import csv
import html
from pathlib import Path

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 0.8em; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
th { background: #f0f0f0; } td.l, th.l { text-align: left; }
figure { margin: 1em 0; } img { max-width: 100%; border: 1px solid #eee; }
.note { color: #666; font-size: 0.85em; } .failed { color: #b00; }
"""


def page(title: str, sections: list[str]) -> str:
    return (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head>\n<body>\n<h1>{html.escape(title)}</h1>\n"
            + "\n".join(sections) + "\n</body></html>\n")


def section(heading: str, *parts: str) -> str:
    return f"<section><h2>{html.escape(heading)}</h2>\n" + "\n".join(parts) + "\n</section>"


def note(text: str, cls: str = "note") -> str:
    return f"<p class='{cls}'>{html.escape(text)}</p>"


def _cell(value) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, str) and ("." in value or "e" in value) and _is_number(value):
        value = float(value)             # a CSV cell: print it like the numbers of a summary
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return html.escape(str(value))


def _is_number(value) -> bool:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return True
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False


def table(columns: list[str], rows: list[list], max_rows: int | None = None) -> str:
    """An HTML table; text columns left-aligned, numbers right; at most
    max_rows rows, with a note saying how many were left out."""
    shown = rows if max_rows is None else rows[:max_rows]
    text_cols = {i for i in range(len(columns)) if any(r[i] not in (None, "") and not _is_number(r[i])
                                                         for r in shown)}
    head = "".join(f"<th class='l'>{html.escape(str(c))}</th>" if i in text_cols else f"<th>{html.escape(str(c))}</th>"
                   for i, c in enumerate(columns))
    body = "\n".join("<tr>" + "".join(f"<td class='l'>{_cell(v)}</td>" if i in text_cols else f"<td>{_cell(v)}</td>"
                                      for i, v in enumerate(r)) + "</tr>" for r in shown)
    out = f"<table><thead><tr>{head}</tr></thead><tbody>\n{body}\n</tbody></table>"
    if len(shown) < len(rows):
        out += note(f"first {len(shown)} of {len(rows)} rows")
    return out


def records_table(records: list[dict], max_rows: int | None = None) -> str:
    """A table of dicts (columns: the union of their keys, first seen first)."""
    columns = list(dict.fromkeys(k for r in records for k in r))
    return table(columns, [[r.get(c) for c in columns] for r in records], max_rows)


def csv_table(path: Path, max_rows: int = 300) -> str:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return note(f"{path.name} is empty")
    return table(rows[0], rows[1:], max_rows) + note(f"from {path.name}"
                                                     + (f" ({len(rows) - 1} rows)" if len(rows) - 1 > max_rows else ""))


def image(path: Path, caption: str | None = None) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (f"<figure><img alt='{html.escape(path.name)}' src='data:image/png;base64,{data}'>"
            f"<figcaption class='note'>{html.escape(caption or path.name)}</figcaption></figure>")


def summary_parts(summary: dict) -> list[str]:
    """An experiment.json as HTML: its scalars in one key/value table, each
    list of dicts as its own table, each dict of dicts as a table with a row
    per key; other values as text."""
    scalars, parts = [], []
    for key, value in summary.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            parts.append(f"<h3>{html.escape(key)}</h3>" + records_table(value, 300))
        elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            parts.append(f"<h3>{html.escape(key)}</h3>" + records_table([{key: k, **v} for k, v in value.items()]))
        else:
            scalars.append([key, value if not isinstance(value, (list, dict)) else str(value)])
    if scalars:
        parts.insert(0, table(["key", "value"], scalars))
    return parts
