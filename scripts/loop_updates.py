#!/usr/bin/env python3
"""What the cloud did for one method in several-seed cdcca-sim runs: updates shipped and
withheld by the guard, the job's time, and the uplink per kept frame.

  scripts/loop_updates.py [--method cd-cca] RUN_DIR [RUN_DIR ...]

RUN_DIR is a cdcca-sim --out folder (seed-N/results.json inside). Per run: the adapted rounds
of every seed and device, how many of their jobs shipped an update and how many the update guard
withheld, the mean job time in seconds, and the uplinked payload bytes per kept frame (the
frames' JPEG, their kept-token masks and the guard's held-out samples, over the frames UTS kept).
"""
import glob
import json
import os
import sys


def main():
    args = sys.argv[1:]
    method = "cd-cca"
    if len(args) >= 2 and args[0] == "--method":
        method, args = args[1], args[2:]
    if not args:
        sys.exit(__doc__)
    print(f"| run ({method}) | adapted rounds | shipped | withheld by the guard | mean job s |"
          " uplink bytes per kept frame |")
    print("|---|---|---|---|---|---|")
    for run_dir in args:
        rounds = []
        for path in sorted(glob.glob(os.path.join(run_dir, "seed-*", "results.json"))):
            for m in json.load(open(path))["methods"]:
                if m.get("method") == method:
                    rounds += [r for r in m["rounds"] if r["round"] > 0]
        if not rounds:
            print(f"| {os.path.basename(run_dir)} | - | - | - | - | - |")
            continue
        withheld = sum(1 for r in rounds if r.get("update_withheld"))
        shipped = sum(1 for r in rounds if r.get("downlink_payload_bytes", 0) > 0)
        jobs = [r["job_seconds"] for r in rounds if r.get("job_seconds", 0) > 0]
        kept = sum(r.get("kept_samples", 0) for r in rounds)
        sent = sum(r.get("uplink_payload_bytes", 0) for r in rounds)
        job_s = f"{sum(jobs) / len(jobs):.1f}" if jobs else "-"
        per_frame = f"{sent / kept:.0f}" if kept else "-"
        print(f"| {os.path.basename(run_dir)} | {len(rounds)} | {shipped} | {withheld} | {job_s} | "
              f"{per_frame} |")


if __name__ == "__main__":
    main()
