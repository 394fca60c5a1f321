#!/usr/bin/env python3
"""Checks a `distro report` site against the registry it was read from.

    dashboard_check.py SITE HOST/REPOSITORY IMAGE PLATFORM=SUMMARY... -- DATE...

For each DATE, SITE/index.html must have a row (`tr.night`, `data-date`) whose `data-digest` is
the digest of the index tagged IMAGE-DATE in the registry (read over plain HTTP: a loopback
registry), and, for each platform of that index, sizes (`span.size`: `data-platform`,
`data-group`, `data-bytes`) equal to its manifest's layers' sizes summed per group (the layer
descriptors' `io.github.llm-distro.layer-group` annotation, `base` without one) and in all.
Each PLATFORM=SUMMARY (a summary.json attached to every date) must show as a `div.test` with
that platform, the summary's device class and its passed, failed and skipped counts. Every date
but the first links (`a.diff`) to a file of SITE that holds `distro diff`'s text. The first
figure, the size trend, is read back: the axes fitted to their tick labels, each legend entry's
colour found, and every drawn point of each platform's `total` mapped back to its date and MiB,
which must equal the table's total within a pixel and a half.
Exit 0 when all holds, 1 otherwise, one line per problem.
"""

import hashlib
import json
import os
import re
import sys
import urllib.request
from html.parser import HTMLParser

GROUP = "io.github.llm-distro.layer-group"
ACCEPT = ", ".join([
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.oci.image.manifest.v1+json",
])


class Page(HTMLParser):
    """The rows of index.html: date -> {digest, sizes{(platform, group): bytes}, tests[], diff}."""

    def __init__(self):
        super().__init__()
        self.rows = {}
        self.row = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = (a.get("class") or "").split()
        if tag == "tr" and "night" in cls:
            self.row = {"digest": a.get("data-digest"), "sizes": {}, "tests": [], "diff": None}
            self.rows[a.get("data-date")] = self.row
        elif self.row is None:
            return
        elif tag == "span" and "size" in cls:
            self.row["sizes"][(a["data-platform"], a["data-group"])] = int(a["data-bytes"])
        elif tag == "div" and "test" in cls:
            self.row["tests"].append({k[5:]: v for k, v in a.items() if k.startswith("data-")})
        elif tag == "a" and "diff" in cls:
            self.row["diff"] = a.get("href")

    def handle_endtag(self, tag):
        if tag == "tr":
            self.row = None


def fetch(host, repository, ref):
    req = urllib.request.Request(f"http://{host}/v2/{repository}/manifests/{ref}", headers={"Accept": ACCEPT})
    with urllib.request.urlopen(req, timeout=30) as r:
        body = r.read()
    return body, "sha256:" + hashlib.sha256(body).hexdigest()


TEXT = re.compile(r'<text x="([-\d.]+)" y="([-\d.]+)"[^>]*text-anchor="(\w+)"[^>]*>\s*([^<]*?)\s*</text>')
LINE = re.compile(r'<polyline [^>]*stroke="(#[0-9A-Fa-f]{6})" stroke-width="2" points="(\d+),(\d+) (\d+),(\d+) "/>')
CIRCLE = re.compile(r'<circle cx="(\d+)" cy="(\d+)" r="\d+" [^>]*fill="(#[0-9A-Fa-f]{6})"')


def trend_points(svg):
    """{legend label: [(date, value)]} of a trend plotters drew, and the value of one pixel."""
    texts = [(float(x), float(y), anchor, t) for x, y, anchor, t in TEXT.findall(svg)]
    yticks = [(y, float(t)) for x, y, anchor, t in texts if anchor == "end" and re.fullmatch(r"-?[\d.]+(e-?\d+)?", t)]
    xticks = [(x, t) for x, y, anchor, t in texts if anchor == "middle" and re.fullmatch(r"\d{4}-\d\d-\d\d", t)]
    (y0, v0), (y1, v1) = max(yticks), min(yticks)  # the bottom tick and the top one
    per_px = (v1 - v0) / (y1 - y0)
    legend_texts = [(y, t) for x, y, anchor, t in texts if anchor == "start"]
    # Legend samples: 20-pixel horizontal strokes; the series' own polylines are longer.
    samples = [(int(ya), c) for c, xa, ya, xb, yb in LINE.findall(svg) if ya == yb and int(xb) - int(xa) == 20]
    points = {}
    for y, label in legend_texts:
        colour = min(samples, key=lambda s: abs(s[0] - y))[1]
        drawn = [(int(cx), int(cy)) for cx, cy, c in CIRCLE.findall(svg) if c == colour]
        points[label] = [(min(xticks, key=lambda t: abs(t[0] - cx))[1], v0 + (cy - y0) * per_px) for cx, cy in drawn]
    return points, abs(per_px)


def platform_name(p):
    name = f"{p['os']}/{p['architecture']}"
    return f"{name}/{p['variant']}" if p.get("variant") else name


def main():
    args = sys.argv[1:]
    if "--" not in args or len(args) < 4:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    cut = args.index("--")
    (site, repo, image), summaries, dates = args[:3], args[3:cut], args[cut + 1:]
    host, repository = repo.split("/", 1)
    page = Page()
    with open(os.path.join(site, "index.html"), encoding="utf-8") as f:
        page.feed(f.read())
    problems = []
    for i, date in enumerate(dates):
        row = page.rows.get(date)
        if row is None:
            problems.append(f"{date}: no row in index.html (rows: {', '.join(sorted(page.rows))})")
            continue
        body, digest = fetch(host, repository, f"{image}-{date}")
        if row["digest"] != digest:
            problems.append(f"{date}: data-digest {row['digest']}, the registry's index is {digest}")
        for entry in json.loads(body)["manifests"]:
            p = platform_name(entry["platform"])
            manifest, _ = fetch(host, repository, entry["digest"])
            want = {}
            for layer in json.loads(manifest)["layers"]:
                g = (layer.get("annotations") or {}).get(GROUP, "base")
                want[g] = want.get(g, 0) + layer["size"]
            want["total"] = sum(want.values())
            shown = {g: b for (q, g), b in row["sizes"].items() if q == p}
            for g, b in want.items():
                if shown.get(g) != b:
                    problems.append(f"{date} {p}: {g} shown as {shown.get(g)} bytes, the layers sum to {b}")
            for g, b in shown.items():
                if g not in want and b != 0:
                    problems.append(f"{date} {p}: {g} shown as {b} bytes, no layer is in that group")
        for spec in summaries:
            platform, path = spec.split("=", 1)
            s = json.load(open(path))
            want = {"platform": platform, "device": s["device_class"], "passed": str(s["passed"]),
                    "failed": str(s["failed"]), "skipped": str(s["skipped"])}
            if want not in row["tests"]:
                problems.append(f"{date}: the attached {path} ({want}) is not shown; shown: {row['tests']}")
        if i == 0:
            continue
        if not row["diff"]:
            problems.append(f"{date}: no diff link")
        elif not os.path.isfile(os.path.join(site, row["diff"])):
            problems.append(f"{date}: the diff link {row['diff']} names no file of {site}")
        elif "distro diff" not in open(os.path.join(site, row["diff"]), encoding="utf-8").read():
            problems.append(f"{date}: {row['diff']} does not hold distro diff's text")
    with open(os.path.join(site, "index.html"), encoding="utf-8") as f:
        html = f.read()
    svg = html[html.index("<svg"):html.index("</svg>")]
    drawn, per_px = trend_points(svg)
    totals = {label: pts for label, pts in drawn.items() if label.endswith(" total")}
    if not totals:
        problems.append(f"the size trend draws no total (legend: {sorted(drawn)})")
    for label, pts in totals.items():
        platform = label[: -len(" total")]
        want = {d: page.rows[d]["sizes"].get((platform, "total"), 0) / 2**20 for d in dates if d in page.rows}
        missing = sorted(set(want) - {d for d, _ in pts})
        if missing:
            problems.append(f"size trend {label}: no point at {missing}")
        for d, v in pts:
            if d in want and abs(v - want[d]) > 1.5 * per_px:
                problems.append(f"size trend {label} {d}: drawn at {v:.6g} MiB, the table says {want[d]:.6g}")
    for p in problems:
        print(p)
    if not problems:
        print(f"dashboard: {len(dates)} date(s) checked against {repo}: digests, sizes per group, test results, diff links, "
              f"the size trend's {sum(len(p) for p in totals.values())} total points")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
