#!/usr/bin/env python3
"""The vision side against the default trainable set, offline: two `cdcca adapt-eval` matrices
(scripts/teacher_all_matrix.sh) on the same shifts and seeds, one with the default trainable set
and one with `--lora_vision`, each with the "all" arm (every frame's tokens, what the cloud reads
from an uplinked frame) and its ground-truth twin (`--ground_truth_arms`), one learner.

Usage: scripts/vision_side_summary.py DEFAULT_DIR VISION_DIR [LEARNER]

Per run (shift and seed): the teacher's lead over the student under the shift and on the same
questions' clean images (the shift's part of the lead), then for each trainable set the gain of
the teacher-labelled job and of the ground-truth job over the un-adapted student, and the
teacher-labelled gain as a share of the lead. Then the mean over the runs of each column and of
the paired difference (vision minus default) with its SE across runs.
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
    cols = {k: [] for k in ("lead", "shift", "d", "dgt", "v", "vgt", "diff", "dshare", "vshare")}
    for name in names:
        d, v = default[name], vision[name]
        lead = d["teacher_accuracy"] - d["source_accuracy"]
        clean_lead = d.get("clean_teacher_accuracy", float("nan")) - d.get(
            "clean_source_accuracy", float("nan"))
        dg, vg = gain(d, "all", learner), gain(v, "all", learner)
        dgt = gain(d, "all+ground-truth", learner)
        vgt = gain(v, "all+ground-truth", learner)
        ds = 100 * dg / lead if lead > 0 else float("nan")
        vs = 100 * vg / lead if lead > 0 else float("nan")
        for k, x in (("lead", lead), ("shift", lead - clean_lead), ("d", dg), ("dgt", dgt),
                     ("v", vg), ("vgt", vgt), ("diff", vg - dg), ("dshare", ds), ("vshare", vs)):
            cols[k].append(x)
        print(f"| {name} | {lead:.2f} | {lead - clean_lead:+.2f} | {dg:+.2f} ({ds:.0f} %) | "
              f"{dgt:+.2f} | {vg:+.2f} ({vs:.0f} %) | {vgt:+.2f} | {vg - dg:+.2f} |")
    m = {k: mean_se(x) for k, x in cols.items()}
    print(f"| mean of {len(names)} (SE) | {m['lead'][0]:.2f} | {m['shift'][0]:+.2f} | "
          f"{m['d'][0]:+.2f} ({m['dshare'][0]:.0f} %) | {m['dgt'][0]:+.2f} | "
          f"{m['v'][0]:+.2f} ({m['vshare'][0]:.0f} %) | {m['vgt'][0]:+.2f} | "
          f"{m['diff'][0]:+.2f} ({m['diff'][1]:.2f}) |")


if __name__ == "__main__":
    main()
