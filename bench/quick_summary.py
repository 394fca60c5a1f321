#!/usr/bin/env python3
"""The summary of `tests/gpu.sh quick` (issue 45): one JSON and one table from the phase's runs.

Reads, in the folder given:
- `gpu-test-*.json`: `engine gpu-test --json`, the checks run and failed;
- `engine-RECIPE-PRECISION-ROUND.json`: `engine bench --json`, bf16 and fp8 at each shape, in
  interleaved rounds (the medians over the rounds are reported);
- `compare-RECIPE-PRECISION-PEER.json`: `bench/compare.py --json`, one round of a peer beside
  the engine at the same shape and precision (`.failed`: the peer did not run).

Writes, per shape: tokens/s, TFLOP/s and MFU of each precision, fp8 / bf16, and each peer's
tokens/s with the engine's ratio to it; and the targets of issue 45 where a shape has them:
fp8 >= 1.35x its own bf16 and >= 705 TFLOP/s on llama3.1-8b's layers, >= 1.2x the fastest FP8
peer, and fp8 never slower than bf16 at any shape.

    python3 bench/quick_summary.py OUT/quick/runs --json OUT/quick/summary.json
"""

import argparse
import glob
import json
import os
import re
import statistics
import sys


def named(folder, prefix, pattern):
    """(path, match) of the files `prefix*` in `folder` whose names match `pattern`, in order."""
    for path in sorted(glob.glob(os.path.join(folder, prefix + "*"))):
        m = re.fullmatch(pattern, os.path.basename(path))
        if m:
            yield path, m


def engine_runs(folder):
    """{recipe: {precision: [run, ...]}} from the engine's bench JSONs."""
    out = {}
    for path, m in named(folder, "engine-", r"engine-(.+)-(bf16|fp8)-(\d+)\.json"):
        r = json.load(open(path))["recipes"][0]
        out.setdefault(m.group(1), {}).setdefault(m.group(2), []).append(r)
    return out


def medians(runs):
    pick = lambda key: statistics.median(r[key] for r in runs)
    return {"tokens_per_s": pick("tokens_per_s"), "tflops": pick("tflops_per_device"), "mfu": pick("mfu"),
            "rounds": len(runs), "device": runs[0]["device"]}


def peers(folder):
    """{recipe: {precision: [{peer, tokens_per_s, engine_over_peer} or {peer, failed}]}}."""
    out = {}
    for path, m in named(folder, "compare-", r"compare-(.+)-(bf16|fp8)-(.+)\.(json|failed)"):
        recipe, precision, peer, kind = m.groups()
        entries = out.setdefault(recipe, {}).setdefault(precision, [])
        if kind == "failed":
            entries.append({"peer": peer, "failed": True})
            continue
        summary = json.load(open(path))["peers"]
        for name, r in summary.items():
            if name != "engine":
                entries.append({"peer": name, "tokens_per_s": r["tokens_per_s"], "tflops": r["tflops"],
                                "engine_over_peer": r["engine_over_peer"]})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    checks = []
    for path in sorted(glob.glob(os.path.join(args.folder, "gpu-test-*.json"))):
        report = json.load(open(path))
        rows = report.get("checks", report) if isinstance(report, dict) else report
        failed = [c.get("name") for c in rows if isinstance(c, dict) and not c.get("passed", True)]
        checks.append({"file": os.path.basename(path), "checks": len(rows), "failed": failed})
    runs, by_peer = engine_runs(args.folder), peers(args.folder)
    if not runs:
        sys.exit(f"bench/quick_summary.py: no engine-*.json under {args.folder}")
    shapes, targets = {}, []
    for recipe, precisions in runs.items():
        shape = {p: medians(r) for p, r in precisions.items()}
        if "bf16" in shape and "fp8" in shape:
            ratio = shape["fp8"]["tokens_per_s"] / shape["bf16"]["tokens_per_s"]
            shape["fp8_over_bf16"] = ratio
            targets.append({"target": f"{recipe}: fp8 never slower than bf16", "value": ratio, "passed": ratio >= 1.0})
            if recipe == "llama3.1-8b":
                targets.append({"target": "llama3.1-8b: fp8 >= 1.35x its own bf16", "value": ratio,
                                "passed": ratio >= 1.35})
                tflops = shape["fp8"]["tflops"]
                targets.append({"target": "llama3.1-8b: fp8 >= 705 TFLOP/s", "value": tflops,
                                "passed": tflops >= 705})
        shape["peers"] = by_peer.get(recipe, {})
        fp8_peers = [p for p in shape["peers"].get("fp8", []) if not p.get("failed")]
        if fp8_peers:
            fastest = max(fp8_peers, key=lambda p: p["tokens_per_s"])
            targets.append({"target": f"{recipe}: fp8 >= 1.2x the fastest FP8 peer ({fastest['peer']})",
                            "value": fastest["engine_over_peer"], "passed": fastest["engine_over_peer"] >= 1.2})
        shapes[recipe] = shape
    summary = {"checks": checks, "shapes": shapes, "targets": targets}
    with open(args.json, "w") as f:
        json.dump(summary, f, indent=2)
    print(f"{'shape':<16} {'precision':<9} {'tokens/s':>12} {'TFLOP/s':>9} {'MFU':>7}")
    for recipe, shape in shapes.items():
        for p in ("bf16", "fp8"):
            if p in shape:
                r = shape[p]
                print(f"{recipe:<16} {p:<9} {r['tokens_per_s']:>12.0f} {r['tflops']:>9.1f} {100 * r['mfu']:>6.1f}%")
        for p, entries in shape["peers"].items():
            for e in entries:
                text = "failed" if e.get("failed") else f"{e['tokens_per_s']:.0f} tokens/s, engine {e['engine_over_peer']:.2f}x"
                print(f"  {p} peer {e['peer']}: {text}")
    for t in targets:
        print(f"{'PASS' if t['passed'] else 'MISS'} {t['target']}: {t['value']:.3f}")
    for c in checks:
        print(f"gpu-test {c['file']}: {c['checks']} checks, {len(c['failed'])} failed")


if __name__ == "__main__":
    main()
