#!/usr/bin/env python3
"""One line per cdcca-sim run folder: how CD-CCA stands against
source-only and every baseline, how much of the teacher's lead it holds, and its lowest round.

  scripts/tables_summary.py RUN_DIR [RUN_DIR ...]

RUN_DIR is a cdcca-sim --out folder of a several-seed run (seeds.json and seed-N/results.json
inside). Every figure is read from those files:
  - "teacher's lead": teacher minus source-only, mean over the adapted rounds and seeds;
  - each "X minus Y": the paired difference on the same questions, mean over rounds, mean over
    seeds (SE across seeds), as seeds.md has it;
  - "share of the lead, last round": per seed, (CD-CCA - source-only) / (teacher -
    source-only) on the last round's questions (mean over devices), then the mean over seeds;
  - "lowest round": CD-CCA's lowest adapted round against source-only over all seeds, with
    its paired z; "below beyond noise": rounds with z < -2, of all adapted rounds of all seeds,
    for CD-CCA, for the other cloud learners together and for TENT and CoTTA together.
A "-" is a figure the run does not have (no teacher, no source-only, a method not run).
"""
import glob
import json
import os
import statistics
import sys


def load(run_dir):
    seeds = json.load(open(os.path.join(run_dir, "seeds.json")))
    runs = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(run_dir, "seed-*",
                                                                        "results.json")))]
    return seeds, runs


def fmt(c):
    if c is None:
        return "-"
    se = c.get("se_across_seeds")
    return "%+.2f (%s)" % (c["mean"], "-" if se is None else "%.2f" % se)


def last_round_da(run, method):
    for m in run["methods"]:
        if m["method"] != method:
            continue
        last = max(r["round"] for r in m["rounds"])
        das = [r["da"] for r in m["rounds"] if r["round"] == last]
        return sum(das) / len(das)
    return None


def line(run_dir):
    seeds, runs = load(run_dir)
    comps = {(c["reference"], c["method"]): c for c in seeds.get("comparisons", [])}
    lowest = {r["method"]: r for r in seeds.get("lowest_round_vs_source_only", [])}
    cdcca = [m["method"] for m in runs[0]["methods"] if m["method"].startswith("cd-cca")]
    out = []
    teacher = comps.get(("teacher", "source-only"))
    for c in cdcca:
        baselines = ", ".join(
            "%s %s" % (m, fmt(comps[(c, m)])) for (r, m) in comps
            if r == c and m not in ("source-only", "teacher"))
        shares = []
        for run in runs:
            so, t, a = (last_round_da(run, x) for x in ("source-only", "teacher", c))
            if None not in (so, t, a) and t > so:
                shares.append(100 * (a - so) / (t - so))
        share = "%.0f %%" % statistics.mean(shares) if shares else "-"
        low = lowest.get(c)
        low_txt, below = "-", "-"
        if low is not None:
            per_seed = [(s, p) for s, p in zip(seeds["seeds"], low["per_seed"]) if p is not None]
            if per_seed:
                s, p = min(per_seed, key=lambda sp: sp[1]["difference"])
                z = p["difference"] / p["standard_error"] if p["standard_error"] > 0 else None
                low_txt = "%+.2f (%s, seed %s round %d)" % (
                    p["difference"], "z -" if z is None else "z %+.1f" % z, s, p["round"])
            below = "%d of %d" % (low["rounds_below_beyond_noise"], low["rounds"])
        def below_of(rows):
            return "%d of %d" % (sum(r["rounds_below_beyond_noise"] for r in rows),
                                 sum(r["rounds"] for r in rows)) if rows else "-"
        cloud = [r for m, r in lowest.items()
                 if not m.startswith("cd-cca") and m not in ("teacher", "tent", "cotta")]
        device = [r for m, r in lowest.items() if m in ("tent", "cotta")]
        out.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            os.path.basename(os.path.normpath(run_dir)), c,
            "-" if teacher is None else "%+.2f" % teacher["mean"],
            fmt(comps.get((c, "source-only"))), baselines or "-", share, low_txt, below,
            below_of(cloud), below_of(device)))
    return "\n".join(out)


def main(argv):
    if len(argv) < 2:
        sys.exit(__doc__)
    print("| run | CD-CCA | teacher's lead | minus source-only (SE) | minus each baseline (SE) |"
          " share of the lead, last round | lowest round | CD-CCA rounds below beyond noise |"
          " other cloud learners' rounds below | TENT and CoTTA rounds below |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for run_dir in argv[1:]:
        if not os.path.isfile(os.path.join(run_dir, "seeds.json")):
            sys.exit(f"no seeds.json in {run_dir}")
        print(line(run_dir))


if __name__ == "__main__":
    main(sys.argv)
