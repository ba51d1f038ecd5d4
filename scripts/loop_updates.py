#!/usr/bin/env python3
"""What the cloud did for one method in several-seed cdcca-sim runs: updates shipped and
withheld by the guard, the job's time, and the uplink per kept frame.

  scripts/loop_updates.py [--method cd-cca] RUN_DIR [RUN_DIR ...]

RUN_DIR is a cdcca-sim --out folder (seed-N/results.json inside). Per run: the adapted rounds
of every seed and device, how many of their jobs shipped an update and how many the update guard
withheld, the mean job time in seconds, and the uplinked payload bytes per kept frame (the
frames' JPEG, their kept-token masks and the guard's held-out samples, over the frames UTS kept).
Where the harness measured the withheld updates (each scored on the round's questions all the
same: `withheld_gain` in results.json), also how many of them would have helped (gain > 0), how
many beyond noise (gain > 2 SE of the paired difference), how many would have cost the device
beyond noise (gain < -2 SE), and their mean gain in points.
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
          " uplink bytes per kept frame | withheld measured: would have helped / beyond noise /"
          " cost beyond noise | their mean gain |")
    print("|---|---|---|---|---|---|---|---|")
    for run_dir in args:
        rounds = []
        for path in sorted(glob.glob(os.path.join(run_dir, "seed-*", "results.json"))):
            for m in json.load(open(path))["methods"]:
                if m.get("method") == method:
                    rounds += [r for r in m["rounds"] if r["round"] > 0]
        if not rounds:
            print(f"| {os.path.basename(run_dir)} | - | - | - | - | - | - | - |")
            continue
        withheld = sum(1 for r in rounds if r.get("update_withheld"))
        shipped = sum(1 for r in rounds if r.get("downlink_payload_bytes", 0) > 0)
        jobs = [r["job_seconds"] for r in rounds if r.get("job_seconds", 0) > 0]
        kept = sum(r.get("kept_samples", 0) for r in rounds)
        sent = sum(r.get("uplink_payload_bytes", 0) for r in rounds)
        job_s = f"{sum(jobs) / len(jobs):.1f}" if jobs else "-"
        per_frame = f"{sent / kept:.0f}" if kept else "-"
        measured = [r for r in rounds if r.get("withheld_measured")]
        if measured:
            helped = sum(1 for r in measured if r["withheld_gain"] > 0)
            beyond = sum(1 for r in measured if r["withheld_gain"] > 2 * r["withheld_gain_se"] > 0)
            cost = sum(1 for r in measured if -r["withheld_gain"] > 2 * r["withheld_gain_se"] > 0)
            mean = sum(r["withheld_gain"] for r in measured) / len(measured)
            verdict, gain = f"{helped} / {beyond} / {cost} of {len(measured)}", f"{mean:+.2f}"
        else:
            verdict, gain = "-", "-"
        print(f"| {os.path.basename(run_dir)} | {len(rounds)} | {shipped} | {withheld} | {job_s} | "
              f"{per_frame} | {verdict} | {gain} |")


if __name__ == "__main__":
    main()
