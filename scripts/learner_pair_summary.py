#!/usr/bin/env python3
"""Two learners of one `cdcca adapt-eval` matrix (scripts/teacher_all_matrix.sh with both in
CDCCA_MATRIX_ARMS's --learners) against each other, on one arm.

Usage: scripts/learner_pair_summary.py DIR LEARNER_A LEARNER_B [ARM]   (ARM: all)

Per run (shift and seed): the teacher's lead over the un-adapted student, each learner's gain
over it and B minus A. Then per shift and over every run, the means and B minus A with its SE
across runs.
"""
import json
import pathlib
import sys

# One definition of a row's gain and of a mean with its SE across runs.
from vision_side_summary import gain, mean_se


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    directory, a, b = sys.argv[1:4]
    arm = sys.argv[4] if len(sys.argv) > 4 else "all"
    runs = {}
    for path in sorted(pathlib.Path(directory).glob("*.json")):
        report = json.loads(path.read_text())
        if "rows" in report:
            runs[path.stem] = report
    if not runs:
        sys.exit(f"no adapt-eval report in {directory}")
    print(f"| run | teacher's lead | {a} | {b} | B minus A |")
    print("|---|---|---|---|---|")
    by_shift = {}
    for name, report in runs.items():
        lead = report["teacher_accuracy"] - report["source_accuracy"]
        ga, gb = gain(report, arm, a), gain(report, arm, b)
        print(f"| {name} | {lead:.2f} | {ga:+.2f} | {gb:+.2f} | {gb - ga:+.2f} |")
        by_shift.setdefault(name.rsplit("_s", 1)[0], []).append((lead, ga, gb))
    print()
    print(f"| shift | teacher's lead | {a} | {b} | B minus A (SE) |")
    print("|---|---|---|---|---|")
    every = []
    for shift, rows in sorted(by_shift.items()) + [("all runs", None)]:
        rows = rows if rows is not None else every
        lead, _ = mean_se([r[0] for r in rows])
        ga, _ = mean_se([r[1] for r in rows])
        gb, _ = mean_se([r[2] for r in rows])
        d, se = mean_se([r[2] - r[1] for r in rows])
        print(f"| {shift} | {lead:.2f} | {ga:+.2f} | {gb:+.2f} | {d:+.2f} ({se:.2f}) |")
        if shift != "all runs":
            every += rows


if __name__ == "__main__":
    main()
