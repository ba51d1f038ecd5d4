#!/usr/bin/env python3
"""Tests of scripts/trace_split.py on a made-up trace (ctest: trace_split_test).

The trace has three training steps, each launching a GEMM from the step's thread and a silu
from the autograd thread (the second running on the GPU after the step's host time ended, as
asynchronous kernels do), one kernel launched before the first step and one launched between
steps: the split must count each step's own kernels, whenever they ran, and nothing else.
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_split  # noqa: E402

GEMM = "nvjet_sm90_tst_256x128_64x4_2x1_v_bz_coopA_NNT"
SILU = "void at::native::vectorized_elementwise_kernel<8, at::native::silu_kernel>"
ROTARY = "void cdcca::model::cuda_kernels::RotaryKernel<__nv_bfloat16, 8>"


def made_up_trace():
    ev = []

    def launch(corr, ts, tid, kernel, k_ts, k_dur):
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 5,
                   "tid": tid, "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": "kernel", "name": kernel, "ts": k_ts, "dur": k_dur,
                   "tid": 7, "args": {"correlation": corr}})

    launch(1, 10, 1, SILU, 20, 900)  # before the first step: not counted
    for i in range(3):
        t = 1000 + 2000 * i
        ev.append({"ph": "X", "cat": "user_annotation", "name": trace_split.STEP, "ts": t,
                   "dur": 1000, "tid": 1})
        # The GPU's copy of the annotation must not count as a step.
        ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": trace_split.STEP, "ts": t,
                   "dur": 1500, "tid": 7})
        launch(100 + i, t + 10, 1, GEMM, t + 20, 300 + 100 * i)
        launch(200 + i, t + 900, 2, SILU, t + 1200, 200)  # runs after the step's host end
        # The host operator that launched the silu (the GPU idles from the GEMM's end until it).
        ev.append({"ph": "X", "cat": "cpu_op", "name": "SiluBackward0", "ts": t + 850, "dur": 100,
                   "tid": 2})
        ev.append({"ph": "X", "cat": "cpu_op", "name": "the step", "ts": t, "dur": 1000, "tid": 1})
        launch(300 + i, t + 1500, 1, ROTARY, t + 1600, 50)  # between steps: not counted
    return {"traceEvents": ev}


class TraceSplitTest(unittest.TestCase):
    def test_the_last_steps_count_their_own_kernels_whenever_they_ran(self):
        r = trace_split.split(made_up_trace()["traceEvents"], last=2)
        self.assertEqual(r["steps"], 2)
        # Steps 2 and 3: GEMMs of 0.4 and 0.5 ms, a silu of 0.2 ms each.
        self.assertAlmostEqual(r["kinds_ms"]["products"], 0.45)
        self.assertAlmostEqual(r["kinds_ms"]["element-wise"], 0.2)
        self.assertNotIn("other", r["kinds_ms"])
        self.assertAlmostEqual(r["kernel_ms"], 0.65)
        self.assertAlmostEqual(r["step_ms_host"], 1.0)
        self.assertAlmostEqual(r["threads_ms"]["the step's thread (forward, losses, optimizer)"], 0.45)
        self.assertAlmostEqual(r["threads_ms"]["other threads (the backward pass)"], 0.2)
        self.assertAlmostEqual(r["elementwise_ops_ms"]["silu"], 0.2)
        self.assertEqual([k["name"] for k in r["kernels"]], [GEMM, SILU])

    def test_the_gpu_idle_inside_a_step_is_filed_under_the_launching_operator(self):
        r = trace_split.split(made_up_trace()["traceEvents"], last=2)
        # Steps 2 and 3: the GEMM ends at 420 and 520 us, the silu starts at 1200: idle 780, 680.
        self.assertAlmostEqual(r["idle_ms"], 0.73)
        self.assertEqual(list(r["idle_by_host_op_ms"]), ["SiluBackward0"])
        self.assertAlmostEqual(r["idle_by_host_op_ms"]["SiluBackward0"]["gaps"], 1.0)
        # Stretches shorter than the threshold are not counted.
        self.assertAlmostEqual(trace_split.split(made_up_trace()["traceEvents"], last=2,
                                                 min_gap_us=700)["idle_ms"], 0.39)

    def test_first_takes_the_first_steps(self):
        r = trace_split.split(made_up_trace()["traceEvents"], last=5, first=1)
        self.assertEqual(r["steps"], 1)
        self.assertAlmostEqual(r["kinds_ms"]["products"], 0.3)
        self.assertAlmostEqual(r["kernel_ms"], 0.5)

    def test_the_program_writes_its_json(self):
        with tempfile.TemporaryDirectory() as d:
            trace, out = os.path.join(d, "t.json"), os.path.join(d, "split.json")
            with open(trace, "w") as f:
                json.dump(made_up_trace(), f)
            script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trace_split.py")
            printed = subprocess.run([sys.executable, script, trace, "--last", "3", "--json", out],
                                     check=True, capture_output=True, text=True).stdout
            self.assertIn("3 steps", printed)
            with open(out) as f:
                self.assertAlmostEqual(json.load(f)["kinds_ms"]["products"], 0.4)

    def test_a_trace_without_steps_is_refused(self):
        with self.assertRaises(SystemExit):
            trace_split.split([{"ph": "X", "cat": "kernel", "name": GEMM, "ts": 0, "dur": 1}], 5)


if __name__ == "__main__":
    unittest.main()
