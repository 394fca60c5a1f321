#!/usr/bin/env python3
"""Loads pages in headless Chromium and fails on what a self-contained page must not do.

    browser_check.py OUT_DIR PAGE...

For each PAGE (a local file: HTML or SVG) Chromium loads file://PAGE headless and keeps a
screenshot, OUT_DIR/NAME.png. The page fails when:
- it writes anything to the console (a static page has nothing to say; Chromium's
  `--enable-logging=stderr` prints each message as a `:CONSOLE` line), or
- it makes a request that is not file:// (the page's requests are read from Chromium's
  `--log-net-log` JSON: every URL_REQUEST_START_JOB made for the page's own site; requests the
  browser makes for itself, with no page behind them, are listed and not held against it), or
- the screenshot is not written, or Chromium fails or takes over 60 s.
Exit 0 when every page passes, 1 otherwise, one line per problem.
"""

import json
import os
import subprocess
import sys
import tempfile

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--hide-scrollbars",
    "--enable-logging=stderr",
    "--v=0",
    "--window-size=1300,1600",
]


def page_requests(net_log):
    """(page's URLs, browser's own URLs) from a net log."""
    with open(net_log) as f:
        log = json.load(f)
    start_job = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    page, own = [], []
    for e in log["events"]:
        p = e.get("params") or {}
        if e["type"] != start_job or "url" not in p:
            continue
        for_page = p.get("initiator") != "not an origin" or "file://" in p.get("network_isolation_key", "")
        (page if for_page else own).append(p["url"])
    return page, own


def check(page, out_dir):
    problems = []
    name = os.path.basename(page)
    shot = os.path.join(out_dir, name + ".png")
    with tempfile.TemporaryDirectory() as tmp:
        net_log = os.path.join(tmp, "net.json")
        cmd = ["chromium", *CHROMIUM_FLAGS, f"--user-data-dir={tmp}/profile", f"--log-net-log={net_log}",
               f"--screenshot={shot}", "file://" + os.path.abspath(page)]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            return [f"{page}: chromium took over 60 s"]
        if run.returncode != 0:
            problems.append(f"{page}: chromium exited {run.returncode}: {run.stderr.strip()[-300:]}")
        for line in run.stderr.splitlines():
            if ":CONSOLE" in line:
                problems.append(f"{page}: console: {line.split('] ', 1)[-1]}")
        if not os.path.exists(net_log):
            problems.append(f"{page}: chromium wrote no net log")
        else:
            page_urls, own = page_requests(net_log)
            for url in page_urls:
                if not url.startswith("file://"):
                    problems.append(f"{page}: requested {url}")
            if own:
                print(f"{name}: {len(own)} request(s) of the browser itself, not the page's, ignored")
    if not os.path.exists(shot) or os.path.getsize(shot) == 0:
        problems.append(f"{page}: no screenshot")
    return problems


def main():
    if len(sys.argv) < 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out_dir, pages = sys.argv[1], sys.argv[2:]
    os.makedirs(out_dir, exist_ok=True)
    problems = []
    for page in pages:
        p = check(page, out_dir)
        print(f"{'ok  ' if not p else 'FAIL'} {page} (screenshot {os.path.join(out_dir, os.path.basename(page))}.png)")
        problems += p
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
