"""The table in markdown and the figure, from run.py's JSON document. No measurement here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

from scenarios import BY_KEY, label  # noqa: E402
from _common import table  # noqa: E402


def markdown(document: dict) -> str:
    env, rows = document["environment"], document["rows"]
    keys = [key for key in BY_KEY if any(key in row["cells"] for row in rows.values())]
    header = ["loader (release)", *(BY_KEY[key].title for key in keys)]
    body = []
    for name, row in rows.items():
        pinned = ", ".join(f"{p} {v}" for p, v in row["versions"].items() if v)
        body.append([f"{name} ({pinned or 'not installed'})",
                     *(label(row["cells"][key]) if key in row["cells"] else "" for key in keys)])
    lines = table(header, body)
    timed = {name: row["first_batch_s"] for name, row in rows.items() if row.get("first_batch_s")}
    if timed:
        lines += ["", "Seconds from the resumed process's start to its first batch (48 samples of 5 ms each, "
                  "0 workers; the median of the rounds):", ""]
        columns = [(kind, p) for kind in ("map", "stream") for p in ("0.1", "0.5", "0.9")]
        lines += table(["loader", *(f"{kind}, at {float(p):.0%}" for kind, p in columns)],
                       [[name, *(_seconds(t.get(kind, {}).get(p)) for kind, p in columns)] for name, t in timed.items()])
    lines += ["", f"Measured on {env['cpu']}, {env['cpu_count']} cores, Python {env['python']}, "
              f"{env['date']}, in {env['benchmark wall time (s)']} s."]
    return "\n".join(lines) + "\n"



def _seconds(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3f}" if isinstance(value, float) else f"failed ({value})"


START, END = "<!-- conformance table: start (make conformance writes it) -->", "<!-- conformance table: end -->"
KINDS = (("exact", "#27ae60"), ("refused", "#f1c40f"), ("wrong", "#c0392b"), ("crashed", "#8e44ad"),
         ("n/a", "#bbbbbb"), ("not yet measured", "#eeeeee"))


def publish(document: dict, page: Path) -> None:
    """Replace the table between the page's markers (the rest of the page is left as it is)."""
    text = page.read_text(encoding="utf-8")
    if START not in text or END not in text:
        raise SystemExit(f"{page} has no conformance markers ({START} ... {END}): add them where the table goes")
    head, rest = text.split(START, 1)
    page.write_text(head + START + "\n\n" + markdown(document) + "\n" + END + rest.split(END, 1)[1], encoding="utf-8")


def figure(document: dict, path: Path) -> None:
    """Left: each loader's cells by verdict. Right: the time to the first batch after a resume."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {name.replace("🤗", "HF"): row for name, row in document["rows"].items()}  # no emoji in the font
    names = list(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 6), gridspec_kw={"width_ratios": [1.3, 1]})
    starts = [0] * len(names)
    for kind, colour in KINDS:
        counts = [sum(c["verdict"] == kind for c in rows[n]["cells"].values()) for n in names]
        left.barh(names, counts, left=starts, color=colour, edgecolor="#666666", linewidth=0.4, label=kind)
        starts = [s + c for s, c in zip(starts, counts)]
    left.invert_yaxis()
    left.set_title("Resumed run against the uninterrupted one (scenarios)")
    left.legend(loc="upper center", bbox_to_anchor=(0.4, -0.1), ncol=6, fontsize=7)
    timed = {n: r["first_batch_s"] for n, r in rows.items() if r.get("first_batch_s")}
    for name, times in timed.items():
        points = [(float(p) * 100, t) for p, t in times.get("stream", {}).items() if isinstance(t, float)]
        if points:
            right.plot(*zip(*points), marker="o", label=name, linewidth=2.5 if name.startswith("ours") else 1.2)
    right.set_xlabel("resumed at % of the epoch")
    right.set_ylabel("seconds to the first batch")
    right.set_title("First batch after resuming a stream (5 ms/sample)")
    right.legend(fontsize=7)
    env = document["environment"]
    fig.text(0.01, 0.01, f"{env['cpu']}, {env['cpu_count']} cores; torch {env['torch']}, accelerate "
             f"{env['accelerate']}, torchdata {env['torchdata']}; {env['date']}", fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    results, page, png = (Path(a) for a in sys.argv[1:4])
    document = json.loads(results.read_text(encoding="utf-8"))
    publish(document, page)
    figure(document, png)
