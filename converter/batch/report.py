"""The batch report: one row per job (source@sha, result, link, verification, time, peak memory, error), as a
terminal table and as a Markdown file, with counts of done / failed / skipped.

Built from the state file only, so the report of a resumed batch covers the earlier runs' jobs too.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from converter.batch.state import Row
from converter.io.units import human_bytes

COLUMNS = ("job", "source@sha", "result", "link", "verification", "time", "peak memory", "error")


def source_at(source: str, sha: str | None) -> str:
    """`org/name@sha10/path` for a Hub source at its commit; a local path as it is."""
    if not sha:
        return source
    org, rest = source.split("/", 1)
    name, _, path = rest.partition("/")
    return f"{org}/{name.partition('@')[0]}@{sha[:10]}" + (f"/{path}" if path else "")


def cells(row: Row, skipped: bool) -> list[str]:
    sources = ", ".join(source_at(s, sha) for s, sha in row.sources.items()) or row.target
    result = row.result or row.status
    if skipped:
        result = f"{result} (skipped: done earlier)"
    return [
        row.id,
        sources,
        result,
        row.url or "",
        row.verdict or "",
        f"{row.seconds:.1f} s" if row.seconds is not None else "",
        human_bytes(row.peak_bytes) if row.peak_bytes else "",
        row.error or "",
    ]


def counts(rows: list[Row], skipped: set[str]) -> dict[str, int]:
    ran = [r for r in rows if r.id not in skipped]
    return {
        "done": sum(r.status == "done" for r in ran),
        "failed": sum(r.status != "done" for r in ran),
        "skipped": len(skipped),
    }


def summary(rows: list[Row], skipped: set[str]) -> str:
    c = counts(rows, skipped)
    return f"{len(rows)} jobs: {c['done']} done, {c['failed']} failed, {c['skipped']} skipped (done earlier)"


def terminal(rows: list[Row], skipped: set[str]) -> str:
    """A plain fixed-width table (no link column: the Markdown file has it)."""
    keep = [0, 1, 2, 4, 5, 6, 7]
    table = [[COLUMNS[i] for i in keep]] + [[cells(r, r.id in skipped)[i] for i in keep] for r in rows]
    widths = [min(max(len(line[i]) for line in table), 60) for i in range(len(keep))]
    widths[-1] = max(len(line[-1]) for line in table)  # the error is never cut
    lines = ["  ".join(c[:w].ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + ["", summary(rows, skipped)])


def markdown(rows: list[Row], skipped: set[str], elapsed: float | None = None) -> str:
    def esc(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    out = ["# converter batch report", "", summary(rows, skipped) + ".", ""]
    if elapsed:
        ran = len(rows) - len(skipped)
        out += [f"This run: {ran} jobs in {elapsed:.1f} s ({60 * ran / elapsed:.1f} jobs/min).", ""]
    out += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        c = [esc(x) for x in cells(row, row.id in skipped)]
        if c[3]:
            c[3] = f"[{urlsplit(c[3]).path.lstrip('/')}]({c[3]})"
        out.append("| " + " | ".join(c) + " |")
    return "\n".join(out) + "\n"


def write_markdown(path: str | Path, text: str) -> None:
    """Write via a temp file and rename, so a report is never half-written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
