#!/usr/bin/env python3
"""Where a training step's GPU time goes, read off a Chrome trace.

Reads the trace `akd_bench --trace` or `hf_akd_reference.py run --trace` writes (LibTorch's or
PyTorch's profiler: host operators, CUDA runtime calls and kernels; each training step a
`cdcca::train_step` annotation) and splits the kernel time of the last N steps by kind of work
(the matrix products, attention, norms, element-wise passes, ...) and by the thread that
launched it (the step's own thread: forward, losses, optimizer; the autograd engine's: the
backward pass). A kernel belongs to the step whose annotation holds the host call that
launched it (matched through the trace's correlation ids), however late it ran on the GPU.

    scripts/trace_split.py TRACE [--last 5 | --first 1] [--top 25] [--json OUT]

Prints a table, milliseconds per step; --json writes the same figures as one JSON object.
"""
import argparse
import bisect
import collections
import json
import sys

STEP = "cdcca::train_step"

# Kinds of kernel by name, the first match deciding. A kernel's name is its C++ symbol: the
# element-wise ones name their functor (silu, mul, add, ...), which the second column reads.
KINDS = [
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("products", ("gemm", "cutlass", "xmma", "nvjet", "gemv", "cublas", "splitk", "sm90_")),
    ("norms", ("norm",)),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("softmax and losses", ("softmax", "nll", "cross_entropy", "logsumexp")),
    ("copies", ("memcpy", "memset", "copy", "cat_", "catarray", "index", "gather", "scatter")),
    ("reductions", ("reduce",)),
    ("element-wise", ("elementwise", "vectorized", "unrolled", "pointwise")),
]
# Element-wise kernels by the operation their functor names.
OPS = ["silu", "sigmoid", "mul", "add", "sub", "neg", "div", "pow", "sqrt", "rsqrt", "exp", "log",
       "where", "fill", "clamp", "cos", "sin", "tanh", "copy", "abs", "max", "min"]


def kind_of(name):
    n = name.lower()
    for kind, keys in KINDS:
        if any(k in n for k in keys):
            return kind
    return "other"


def op_of(name):
    n = name.lower()
    for op in OPS:
        if op in n:
            return op
    return "?"


def short(name, width=90):
    return name if len(name) <= width else name[: width - 3] + "..."


def innermost_ops(events):
    """Per thread: host operators sorted by start, to find the one enclosing a launch."""
    ops = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "cpu_op":
            ops[e.get("tid")].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
    for v in ops.values():
        v.sort()
    return ops


def enclosing(ops, tid, ts, window=400):
    """The latest-starting host operator on `tid` that holds time `ts` ("?" where none does)."""
    v = ops.get(tid, [])
    i = bisect.bisect_right(v, (ts, float("inf"), "")) - 1
    for j in range(i, max(-1, i - window), -1):
        if v[j][0] <= ts <= v[j][1]:
            return v[j][2]
    return "?"


def idle_gaps(intervals, min_us):
    """Idle stretches between merged busy intervals [(start, end, key)] sorted by start:
    [(gap_us, key of the interval after the gap)] for gaps of at least min_us."""
    gaps, end = [], None
    for ts, te, key in intervals:
        if end is not None and ts - end >= min_us:
            gaps.append((ts - end, key))
        end = te if end is None else max(end, te)
    return gaps


def split(events, last, first=0, min_gap_us=10.0):
    steps = sorted((e for e in events if e.get("name") == STEP and e.get("ph") == "X"
                    and "gpu" not in str(e.get("cat", "")).lower()), key=lambda e: e["ts"])
    if not steps:
        sys.exit(f"no {STEP} annotations in the trace")
    steps = steps[:first] if first > 0 else steps[-last:]
    starts = [s["ts"] for s in steps]
    step_tid = collections.Counter(s.get("tid") for s in steps).most_common(1)[0][0]
    # One pass over the CUDA runtime's host calls inside the steps: those that launch GPU work,
    # by correlation id (step index, launching thread, launch time), and the host time in the
    # runtime by call (allocations, synchronizations, launches).
    launch = {}
    runtime = collections.defaultdict(float)
    for e in events:
        cat = str(e.get("cat", "")).lower()
        if e.get("ph") != "X" or cat not in ("cuda_runtime", "runtime", "cuda_driver"):
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i < 0 or e["ts"] > steps[i]["ts"] + steps[i]["dur"]:
            continue
        runtime[e["name"]] += e["dur"] / 1000.0
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            launch[corr] = (i, e.get("tid"), e["ts"])
    by_kind = collections.defaultdict(float)
    by_thread = collections.defaultdict(float)
    by_name = collections.defaultdict(lambda: [0.0, 0])
    by_op = collections.defaultdict(float)
    first_ts, last_end = {}, {}
    busy = collections.defaultdict(list)  # step -> [(start, end, launching correlation)]
    for e in events:
        cat = str(e.get("cat", "")).lower()
        if e.get("ph") != "X" or cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        corr = (e.get("args") or {}).get("correlation")
        if corr not in launch:
            continue
        i, tid, _ = launch[corr]
        busy[i].append((e["ts"], e["ts"] + e["dur"], corr))
        dur = e["dur"] / 1000.0  # microseconds to ms
        kind = kind_of(e["name"]) if cat == "kernel" else "copies"
        by_kind[kind] += dur
        by_thread["the step's thread (forward, losses, optimizer)" if tid == step_tid else
                  "other threads (the backward pass)"] += dur
        by_name[e["name"]][0] += dur
        by_name[e["name"]][1] += 1
        if kind == "element-wise":
            by_op[op_of(e["name"])] += dur
        first_ts[i] = min(first_ts.get(i, e["ts"]), e["ts"])
        last_end[i] = max(last_end.get(i, 0), e["ts"] + e["dur"])
    n = len(steps)
    # The GPU's idle stretches inside each step, filed under the host operator that launched
    # the kernel ending each one (what the host was doing while the GPU waited).
    ops = innermost_ops(events)
    gap_by_op = collections.defaultdict(lambda: [0.0, 0])
    idle = 0.0
    for i, intervals in busy.items():
        for gap_us, corr in idle_gaps(sorted(intervals), min_gap_us):
            _, tid, ts = launch[corr]
            op = enclosing(ops, tid, ts)
            gap_by_op[op][0] += gap_us / 1000.0
            gap_by_op[op][1] += 1
            idle += gap_us / 1000.0
    kernels_ms = sum(by_kind.values()) / n
    wall = sum(s["dur"] for s in steps) / 1000.0 / n
    span = sum(last_end[i] - first_ts[i] for i in first_ts) / 1000.0 / max(1, len(first_ts))
    return {
        "steps": n,
        "step_ms_host": wall,
        "step_ms_gpu_span": span,
        "kernel_ms": kernels_ms,
        "idle_ms": idle / n,
        "idle_min_gap_us": min_gap_us,
        "idle_by_host_op_ms": {k: {"ms": v[0] / n, "gaps": v[1] / n}
                               for k, v in sorted(gap_by_op.items(), key=lambda kv: -kv[1][0])[:25]},
        "kinds_ms": {k: v / n for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "threads_ms": {k: v / n for k, v in by_thread.items()},
        "elementwise_ops_ms": {k: v / n for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])},
        "host_runtime_ms": {k: v / n for k, v in sorted(runtime.items(), key=lambda kv: -kv[1])[:8]},
        "kernels": [{"name": k, "ms": v[0] / n, "calls": v[1] / n}
                    for k, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--last", type=int, default=5, help="the last N training steps")
    ap.add_argument("--first", type=int, default=0,
                    help="the first N training steps instead of the last (where a first step is slow)")
    ap.add_argument("--top", type=int, default=25, help="kernels listed by time")
    ap.add_argument("--min_gap_us", type=float, default=10.0,
                    help="idle stretches of the GPU inside a step shorter than this are not counted")
    ap.add_argument("--json", default="", help="the figures as one JSON object here too")
    args = ap.parse_args()
    with open(args.trace) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    r = split(events, args.last, args.first, args.min_gap_us)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**r, "kernels": r["kernels"][: max(args.top, 60)]}, f, indent=1)
    print(f"{r['steps']} steps: host {r['step_ms_host']:.1f} ms a step, GPU from first to last "
          f"kernel {r['step_ms_gpu_span']:.1f} ms, kernels {r['kernel_ms']:.1f} ms, GPU idle inside "
          f"the step {r['idle_ms']:.1f} ms (stretches of {r['idle_min_gap_us']:g} us or more)")
    for title, table in (("kind", r["kinds_ms"]), ("launched by", r["threads_ms"]),
                         ("element-wise by operation", r["elementwise_ops_ms"]),
                         ("host time in CUDA's runtime (not kernel time)", r["host_runtime_ms"])):
        print(f"  {title}:")
        for k, v in table.items():
            print(f"    {v:8.2f} ms  {100 * v / max(r['kernel_ms'], 1e-9):5.1f} %  {k}")
    print("  GPU idle by the host operator launching the kernel after it:")
    for k, v in list(r["idle_by_host_op_ms"].items())[:12]:
        print(f"    {v['ms']:8.2f} ms {v['gaps']:6.1f} gaps  {short(k)}")
    print("  kernels:")
    for k in r["kernels"][: args.top]:
        print(f"    {k['ms']:8.2f} ms {k['calls']:6.1f} calls  {short(k['name'])}")


if __name__ == "__main__":
    main()
