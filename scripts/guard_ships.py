#!/usr/bin/env python3
"""What the update guard measured against what an update did, over cdcca-sim runs.

  scripts/guard_ships.py RUN_DIR [RUN_DIR ...]

RUN_DIR is a cdcca-sim --out folder (seed-N/results.json inside, or results.json itself).
For every update the guard shipped in a round whose domain is the previous round's (the
evaluation scenes are then the same, so the round's DA minus the previous round's is what
the update did on the test), one row: the guard's gain on its held-out pool (score after the
job minus before) and the test change in DA points, with the round's paired z against
source-only where the run reports it. Then, per run folder and over all: how many shipped
updates raised and lowered the test DA, and the correlation of the guard's gain with the
test change. Rounds that change domain, withheld updates and returns to the base are left
out: no test figure says what a withheld update would have done.
"""
import glob
import json
import os
import statistics
import sys

DEVICE_SIDE = {"source-only", "teacher", "tent", "cotta"}


def results_files(run_dir):
    if os.path.isfile(os.path.join(run_dir, "results.json")):
        return [os.path.join(run_dir, "results.json")]
    return sorted(glob.glob(os.path.join(run_dir, "seed-*", "results.json")))


def shipped(path):
    run = json.load(open(path))
    rows = []
    for m in run["methods"]:
        if m["method"] in DEVICE_SIDE:
            continue
        z_of = {r["round"]: (r["difference"] / r["standard_error"] if r["standard_error"] > 0
                             else None)
                for r in m.get("rounds_vs_source_only", [])}
        rounds = m["rounds"]
        for prev, cur in zip(rounds, rounds[1:]):
            if cur["round"] == 0 or cur["device"] != prev["device"]:
                continue
            if cur["update_withheld"] or cur["restored_base"] or cur["domain"] != prev["domain"]:
                continue
            g = cur["guard"]
            rows.append({"seed": run["seed"], "method": m["method"], "round": cur["round"],
                         "guard_gain": g["after"] - g["before"], "pool": g["pool"],
                         "test_change": cur["da"] - prev["da"], "z": z_of.get(cur["round"])})
    return rows


def summary(label, rows):
    if not rows:
        return f"| {label} | 0 | - | - | - |"
    up = sum(1 for r in rows if r["test_change"] > 0)
    down = sum(1 for r in rows if r["test_change"] < 0)
    corr = "-"
    if len(rows) > 2 and len({r["guard_gain"] for r in rows}) > 1 and \
            len({r["test_change"] for r in rows}) > 1:
        corr = "%+.2f" % statistics.correlation([r["guard_gain"] for r in rows],
                                                [r["test_change"] for r in rows])
    mean = statistics.mean(r["test_change"] for r in rows)
    return f"| {label} | {len(rows)} | {up} / {down} | {mean:+.2f} | {corr} |"


def main(argv):
    if len(argv) < 2:
        sys.exit(__doc__)
    every = []
    lines = ["| run | seed | method | round | guard pool | guard gain | test change, DA points |"
             " round vs source-only, z |", "|---|---|---|---|---|---|---|---|"]
    per_run = []
    for run_dir in argv[1:]:
        files = results_files(run_dir)
        if not files:
            sys.exit(f"no results.json in {run_dir}")
        rows = [r for f in files for r in shipped(f)]
        label = os.path.basename(os.path.normpath(run_dir))
        for r in rows:
            z = "-" if r["z"] is None else "%+.1f" % r["z"]
            lines.append(f"| {label} | {r['seed']} | {r['method']} | {r['round']} | {r['pool']} |"
                         f" {r['guard_gain']:+.3f} | {r['test_change']:+.2f} | {z} |")
        per_run.append(summary(label, rows))
        every += rows
    print("\n".join(lines))
    print("\n| runs | shipped updates | test up / down | mean test change | correlation, guard"
          " gain with test change |\n|---|---|---|---|---|")
    print("\n".join(per_run))
    print(summary("all", every))


if __name__ == "__main__":
    main(sys.argv)
