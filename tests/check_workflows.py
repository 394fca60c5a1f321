#!/usr/bin/env python3
"""Project rules for .github/workflows/*.yaml that actionlint does not check, plus shellcheck on
every `run:` block (as actionlint does, for machines where actionlint itself cannot be installed).

Rules: every `uses:` is pinned by a full 40-hex commit SHA with a `# vX.Y.Z` comment, and only
the actions listed in ALLOWED are used; every workflow sets top-level `permissions` and
`concurrency`; every job sets `timeout-minutes`.

    python3 tests/check_workflows.py [--shellcheck PATH] [FILE...]

Exits 1 listing every problem as FILE:LINE: message.
"""
import argparse
import glob
import re
import subprocess
import sys
import tempfile

import yaml

ALLOWED = {
    "actions/checkout",
    "actions/upload-artifact",
    "actions/download-artifact",
    "actions/github-script",
    "actions/cache",
}
USES = re.compile(r"^\s*(?:-\s+)?uses:\s*(\S+?)@(\S+)(.*)$")


def check(path, shellcheck, problems):
    text = open(path, encoding="utf-8").read()
    for n, line in enumerate(text.splitlines(), 1):
        m = USES.match(line)
        if not m:
            continue
        action, ref, rest = m.groups()
        if action not in ALLOWED:
            problems.append(f"{path}:{n}: {action} is not an allowed action ({', '.join(sorted(ALLOWED))})")
        if not re.fullmatch(r"[0-9a-f]{40}", ref):
            problems.append(f"{path}:{n}: {action}@{ref} is not pinned by a full commit SHA")
        if not re.match(r"\s*#\s*v\d+(\.\d+)*\s*$", rest):
            problems.append(f"{path}:{n}: {action} needs a version comment (# vX.Y.Z)")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problems.append(f"{path}:{mark.line + 1 if mark else 1}: not valid YAML: {getattr(e, 'problem', e)}")
        return
    for key in ("permissions", "concurrency"):
        if key not in doc:
            problems.append(f"{path}:1: no top-level `{key}`")
    for name, job in (doc.get("jobs") or {}).items():
        if "timeout-minutes" not in job:
            problems.append(f"{path}: job {name}: no timeout-minutes")
        if not shellcheck:
            continue
        for i, step in enumerate(job.get("steps") or []):
            script = step.get("run")
            if not script:
                continue
            # Expressions are substituted by the runner before bash sees the script.
            body = re.sub(r"\$\{\{.*?\}\}", "EXPR", script)
            with tempfile.NamedTemporaryFile("w", suffix=".sh") as f:
                f.write("#!/usr/bin/env bash\nset -eo pipefail\n" + body)
                f.flush()
                out = subprocess.run([shellcheck, "-f", "gcc", "-S", "style", f.name], capture_output=True, text=True)
            for line in out.stdout.splitlines():
                msg = line.split(":", 3)[-1].strip()
                problems.append(f"{path}: job {name} step {i + 1} ({step.get('name', 'run')}): {msg}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shellcheck")
    p.add_argument("files", nargs="*")
    a = p.parse_args()
    files = a.files or sorted(glob.glob(".github/workflows/*.yaml") + glob.glob(".github/workflows/*.yml"))
    if not files:
        print("no workflows found", file=sys.stderr)
        return 1
    problems = []
    for f in files:
        check(f, a.shellcheck, problems)
    for pr in problems:
        print(pr)
    print(f"{len(files)} workflows checked, {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
