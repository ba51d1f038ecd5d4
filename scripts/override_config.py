#!/usr/bin/env python3
"""Writes a family config with some fields replaced: override_config.py SRC DST KEY=VALUE...

KEY is a dotted path into the JSON (student.lm_layers, pretrain.teacher.steps); VALUE is JSON.
Used by gpu_schedules.sh and student_variants.sh."""
import json
import sys


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    src, dst, pairs = argv[1], argv[2], argv[3:]
    with open(src) as f:
        config = json.load(f)
    for pair in pairs:
        key, value = pair.split("=", 1)
        *path, last = key.split(".")
        node = config
        for k in path:
            node = node[k]
        if last not in node:
            sys.exit(f"override_config: {key} is not in {src}")
        node[last] = json.loads(value)
    with open(dst, "w") as f:
        json.dump(config, f, indent=1)


if __name__ == "__main__":
    main(sys.argv)
