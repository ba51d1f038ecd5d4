#!/usr/bin/env python3
"""CD-CCA against the cloud baselines when they ran in a separate cdcca-sim run of the same
experiment and seeds (the two runs share source-only: the script checks it answered alike,
round by round, so the runs saw the same stream and questions, before pairing).

  scripts/baselines_pair.py CDCCA_RUN BASELINES_RUN [CDCCA_RUN BASELINES_RUN ...]

Each RUN is a cdcca-sim --out folder (seeds.json, seed-N/results.json). Per pair of runs, one
row: each method minus source-only (seeds.json's per-seed paired differences, mean over
seeds, SE across seeds), CD-CCA minus each baseline (the per-seed differences of the two
minus source-only, which share the questions, then mean and SE across seeds), and each
method's adapted rounds below source-only beyond noise (z < -2); with several pairs, a last
row over every (run, seed), its SE across them.
"""
import glob
import json
import os
import statistics
import sys


def per_seed(run_dir, method):
    seeds = json.load(open(os.path.join(run_dir, "seeds.json")))
    for c in seeds["comparisons"]:
        if c["reference"] == method and c["method"] == "source-only":
            below = next(x["rounds_below_beyond_noise"] for x in seeds["lowest_round_vs_source_only"]
                         if x["method"] == method)
            return c["per_seed"], below
    raise SystemExit(f"{run_dir}: no {method} minus source-only")


def source_only_das(run_dir):
    out = {}
    for f in sorted(glob.glob(os.path.join(run_dir, "seed-*", "results.json"))):
        r = json.load(open(f))
        m = next(m for m in r["methods"] if m["method"] == "source-only")
        out[r["seed"]] = [round(x["da"], 6) for x in m["rounds"]]
    return out


def mean_se(values):
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
    return f"{statistics.mean(values):+.2f} ({se:.2f})"


def main(args):
    if not args or len(args) % 2:
        raise SystemExit(__doc__)
    baselines = ("pl", "pkd", "cwd")
    print("| run | CD-CCA minus source-only | " + " | ".join(f"{b.upper()} minus source-only"
                                                            for b in baselines) +
          " | " + " | ".join(f"CD-CCA minus {b.upper()}" for b in baselines) +
          " | rounds below beyond noise (CD-CCA, " + ", ".join(b.upper() for b in baselines) + ") |")
    print("|---" * (2 + 2 * len(baselines)) + "|---|")
    every = {"cd-cca": [], **{b: [] for b in baselines}}
    for cdcca_run, base_run in zip(args[::2], args[1::2]):
        if source_only_das(cdcca_run) != source_only_das(base_run):
            raise SystemExit(f"{cdcca_run} and {base_run}: source-only answered differently")
        ours, ours_below = per_seed(cdcca_run, "cd-cca")
        every["cd-cca"] += ours
        cells, diffs, belows = [mean_se(ours)], [], [str(ours_below)]
        for b in baselines:
            theirs, below = per_seed(base_run, b)
            every[b] += theirs
            cells.append(mean_se(theirs))
            diffs.append(mean_se([o - t for o, t in zip(ours, theirs)]))
            belows.append(str(below))
        name = os.path.basename(os.path.normpath(cdcca_run))
        print(f"| {name} | " + " | ".join(cells + diffs) + " | " + ", ".join(belows) + " |")
    if len(args) > 2:
        ours = every["cd-cca"]
        cells = [mean_se(ours)] + [mean_se(every[b]) for b in baselines]
        diffs = [mean_se([o - t for o, t in zip(ours, every[b])]) for b in baselines]
        print(f"| all {len(ours)} runs | " + " | ".join(cells + diffs) + " | |")


if __name__ == "__main__":
    main(sys.argv[1:])
