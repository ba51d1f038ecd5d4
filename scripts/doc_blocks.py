#!/usr/bin/env python3
"""Runs the command blocks of README.md and docs/guides/*.md that are marked runnable.

A block is runnable when its fence reads ```sh runnable. Each file's runnable blocks run in
order as one bash script (`set -euo pipefail`), in a fresh directory whose `build` is the build
tree and whose other entries (models/, configs/, tests/, scripts/, ...) are the checkout's, so a
block is written as a reader types it from the repository root: `build/sim/cdcca-sim ...`.
Files a block writes stay in that directory, which is removed afterwards.

  scripts/doc_blocks.py BUILD_DIR                 # every file; exit 1 if any block fails
  scripts/doc_blocks.py BUILD_DIR docs/guides/deploy.md
  scripts/doc_blocks.py --list                    # print the runnable blocks

ctest's doc_blocks_test runs it, so a renamed flag or program breaks the tests, not the reader.
Blocks that need a GPU, a download or a long run are fenced as plain ```sh and not run.
"""
import argparse
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^```(\S*)(.*)$")


def doc_files():
    return [os.path.join(ROOT, "README.md")] + sorted(
        glob.glob(os.path.join(ROOT, "docs", "guides", "*.md")))


def runnable_blocks(path):
    """[(first line number, text)] of the file's ```sh runnable blocks."""
    blocks, current, start = [], None, 0
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            m = FENCE.match(line.rstrip("\n"))
            if current is None:
                if m and m.group(1) == "sh" and m.group(2).split() == ["runnable"]:
                    current, start = [], number + 1
            elif line.startswith("```"):
                blocks.append((start, "".join(current)))
                current = None
            else:
                current.append(line)
    if current is not None:
        raise SystemExit(f"{path}:{start}: runnable block never closed")
    return blocks


def run_file(build, path, timeout):
    blocks = runnable_blocks(path)
    if not blocks:
        return True, 0.0
    work = tempfile.mkdtemp(prefix="cdcca-doc-")
    try:
        for entry in os.listdir(ROOT):
            if entry not in ("build", ".git") and not entry.startswith("build"):
                os.symlink(os.path.join(ROOT, entry), os.path.join(work, entry))
        os.symlink(build, os.path.join(work, "build"))
        script = ["set -euo pipefail"]
        for line, text in blocks:
            script.append(f"echo '--- {os.path.relpath(path, ROOT)}:{line}' >&2")
            script.append(text)
        started = time.monotonic()
        proc = subprocess.Popen(["bash", "-c", "\n".join(script)], cwd=work,
                                start_new_session=True,
                                env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            # Whatever a block left running in the background (a cloud) ends with the file.
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        seconds = time.monotonic() - started
        if rc != 0:
            sys.stderr.write(f"FAILED: {os.path.relpath(path, ROOT)} ({rc}) after {seconds:.0f} s\n")
            return False, seconds
        return True, seconds
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the runnable blocks")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per file")
    parser.add_argument("build", nargs="?")
    parser.add_argument("files", nargs="*")
    args = parser.parse_args()
    files = [os.path.abspath(f) for f in args.files] or doc_files()
    if args.list:
        for path in files:
            for line, text in runnable_blocks(path):
                print(f"--- {os.path.relpath(path, ROOT)}:{line}\n{text}")
        return 0
    if not args.build:
        parser.error("BUILD_DIR is required")
    build = os.path.abspath(args.build)
    ok = True
    for path in files:
        passed, seconds = run_file(build, path, args.timeout)
        print(f"{'ok' if passed else 'FAILED'}: {os.path.relpath(path, ROOT)} ({seconds:.0f} s)")
        ok = ok and passed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
