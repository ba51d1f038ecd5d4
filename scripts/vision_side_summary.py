#!/usr/bin/env python3
"""The vision side against the default trainable set, offline: two `cdcca adapt-eval` matrices
(scripts/teacher_all_matrix.sh) on the same shifts and seeds, one with the default trainable set
and one with `--lora_vision`, each with the "all" arm (every frame's tokens, what the cloud reads
from an uplinked frame) and its ground-truth twin (`--ground_truth_arms`), one learner.

Usage: scripts/vision_side_summary.py DEFAULT_DIR VISION_DIR [LEARNER]

Per run (shift and seed): the teacher's lead over the student under the shift and on the same
questions' clean images (the shift's part of the lead), then for each trainable set the gain of
the teacher-labelled job and of the ground-truth job over the un-adapted student, and the
teacher-labelled gain as a share of the lead. Then, per shift and over every run, the mean of
each column and of the paired difference (vision minus default) with its SE across runs.
"""
import json
import math
import pathlib
import sys


def load(directory):
    runs = {}
    for path in sorted(pathlib.Path(directory).glob("*.json")):
        report = json.loads(path.read_text())
        if "rows" in report:
            runs[path.stem] = report
    return runs


def gain(report, arm, learner):
    for row in report["rows"]:
        if row["arm"] == arm and row["learner"] == learner:
            return row["gain"]
    return float("nan")


def mean_se(values):
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return float("nan"), float("nan")
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, float("nan")
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
    return m, math.sqrt(var / len(values))


def share(gain_points, lead):
    """A gain as a share of the teacher's lead; "-" where the lead is under one point."""
    return f"{100 * gain_points / lead:.0f} %" if lead >= 1 else "-"


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    default, vision = load(sys.argv[1]), load(sys.argv[2])
    learner = sys.argv[3] if len(sys.argv) > 3 else "akd+l_kl=0.5"
    names = [n for n in default if n in vision]
    if not names:
        sys.exit("no run is in both directories")
    print("| run | teacher's lead | its shift part | default: gain (share) | default: ground truth"
          " | vision: gain (share) | vision: ground truth | vision minus default |")
    print("|---|---|---|---|---|---|---|---|")
    cols = {k: [] for k in ("lead", "shift", "d", "dgt", "v", "vgt", "diff")}
    for name in names:
        d, v = default[name], vision[name]
        lead = d["teacher_accuracy"] - d["source_accuracy"]
        clean_lead = d.get("clean_teacher_accuracy", float("nan")) - d.get(
            "clean_source_accuracy", float("nan"))
        dg, vg = gain(d, "all", learner), gain(v, "all", learner)
        dgt = gain(d, "all+ground-truth", learner)
        vgt = gain(v, "all+ground-truth", learner)
        for k, x in (("lead", lead), ("shift", lead - clean_lead), ("d", dg), ("dgt", dgt),
                     ("v", vg), ("vgt", vgt), ("diff", vg - dg)):
            cols[k].append(x)
        print(f"| {name} | {lead:.2f} | {lead - clean_lead:+.2f} | {dg:+.2f} ({share(dg, lead)}) | "
              f"{dgt:+.2f} | {vg:+.2f} ({share(vg, lead)}) | {vgt:+.2f} | {vg - dg:+.2f} |")
    # Per shift (the run name before "_s<seed>"), then over every run.
    groups = {}
    for i, name in enumerate(names):
        groups.setdefault(name.rsplit("_s", 1)[0], []).append(i)
    groups["all runs"] = list(range(len(names)))
    for group, rows in groups.items():
        m = {k: mean_se([x[i] for i in rows]) for k, x in cols.items()}
        # The share of the mean lead (a per-run share is unbounded where the lead is near 0).
        lead = m["lead"][0]
        dshare = share(m["d"][0], lead)
        vshare = share(m["v"][0], lead)
        print(f"| **{group}**, mean of {len(rows)} (SE) | {lead:.2f} | "
              f"{m['shift'][0]:+.2f} | {m['d'][0]:+.2f} ({dshare}) | "
              f"{m['dgt'][0]:+.2f} | {m['v'][0]:+.2f} ({vshare}) | "
              f"{m['vgt'][0]:+.2f} | {m['diff'][0]:+.2f} ({m['diff'][1]:.2f}) |")


if __name__ == "__main__":
    main()
