#!/usr/bin/env python3
"""Random-weight copies of a benchmark folder where neither torch nor numpy is installed.

  skeleton SRC DST   copies SRC's small files (config, inputs) and, for each
                     *.safetensors weight file, only its header (as NAME.header)
  fill SKEL DST      writes a folder with the skeleton's files and weight files of the same
                     names, dtypes and shapes, filled with random values in +-[0.004, 0.03]
                     (bf16/f16/f32; speed does not depend on the values, but NaN, inf or
                     denormals would change it)

The GPU machine makes the skeleton of the 0.5B folder (scripts/hf_bench_gpu.sh gpu); the
2-core machine fills it and runs cdcca's decode_bench on CPU.
"""
import json
import os
import shutil
import struct
import sys

WEIGHTS_SKIP = {"bench_inputs.safetensors"}


def skeleton(src, dst):
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if name.endswith(".safetensors") and name not in WEIGHTS_SKIP:
            with open(path, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                header = f.read(n)
            with open(os.path.join(dst, name + ".header"), "wb") as f:
                f.write(header)
        elif os.path.isfile(path):
            shutil.copy(path, os.path.join(dst, name))


def random_values(nbytes, dtype):
    """nbytes of little-endian floats of magnitude 2^-8 .. 2^-5 with random signs."""
    raw = bytearray(os.urandom(nbytes))
    if dtype in ("BF16", "F16"):
        # High byte of each 2-byte value: sign and exponent (bf16: 2^-8..2^-6;
        # f16: 2^-7..2^-6); low byte random mantissa bits.
        base = 0x3B if dtype == "BF16" else 0x20
        table = bytes((b & 0x80) | (base + b % 3) for b in range(256))
        raw[1::2] = bytes(raw[1::2]).translate(table)
    elif dtype == "F32":
        table = bytes((b & 0x80) | (0x3B + b % 3) for b in range(256))
        raw[3::4] = bytes(raw[3::4]).translate(table)
    else:
        raise SystemExit(f"unsupported weight dtype {dtype}")
    return raw


def fill(skel, dst):
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(skel):
        path = os.path.join(skel, name)
        if not name.endswith(".header"):
            shutil.copy(path, os.path.join(dst, name))
            continue
        header = open(path, "rb").read()
        meta = json.loads(header)
        with open(os.path.join(dst, name[: -len(".header")]), "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            entries = sorted((v["data_offsets"], v["dtype"]) for k, v in meta.items() if k != "__metadata__")
            pos = 0
            for (begin, end), dtype in entries:
                assert begin == pos, "gap in the data section"
                f.write(random_values(end - begin, dtype))
                pos = end


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("skeleton", "fill"):
        raise SystemExit(__doc__)
    (skeleton if sys.argv[1] == "skeleton" else fill)(sys.argv[2], sys.argv[3])
