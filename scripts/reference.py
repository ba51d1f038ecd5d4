#!/usr/bin/env python3
"""docs/REFERENCE.md, generated from the code: every flag, experiment-file key and status field.

  scripts/reference.py BUILD_DIR docs/REFERENCE.md           # rewrite the file
  scripts/reference.py --check BUILD_DIR docs/REFERENCE.md   # exit 1 if it differs

Where each part comes from:
- flags: each program's and each `cdcca` sub-command's own --help (the sub-commands are the
  ones `cdcca help` lists);
- experiment-file keys: the parser itself. cdcca-sim is handed files with an unknown key at
  each level, and its refusal lists the keys that level knows; the default of a key is what
  `cdcca-sim --print_config` resolves for an experiment that leaves it out, else the
  initializer of the field it is read into (sim/experiment.cc's Read, sim/experiment.h);
  the text is the help of the flag of the same name, else HARNESS_KEYS below;
- status-file fields: the code that writes them (cloud/open_cloud.cc's Cloud::Parts::Status,
  tools/cdcca_device_main.cc's StatusJson and LingerOutcome), described by STATUS_FIELDS below.

The check runs in the default test suite (ctest reference_test): a flag, key or field added,
renamed or given a new default without regenerating the file fails the tests, and so does a
key or field that this script has no description for, or describes but the code lacks.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAG_LINE = re.compile(r"^  --(\S+)  (.*) \(default: (.*)\)$")

# Experiment keys that are no program's flag: (what it sets). Keys named as a flag take the
# flag's help text.
HARNESS_KEYS = {
    "": {
        "name": "the experiment's name (required): the report's title line and runs/<name>",
        "task": "vqa or caption (a captioning run: in-, near- and out-of-domain scenes every round, "
                "BLEU-4 and CIDEr-D; no schedule; needs a family trained with captions)",
        "title": "the report's title",
        "paper_table": "the paper's table this experiment reproduces, e.g. \"Table 6\" (empty: not in the paper)",
        "description": "what the experiment measures, printed at the head of report.md",
        "devices": "devices in the run, 1-64; each has its own mirror in the cloud",
        "rounds": "rounds, 1-100; each round every device streams, uplinks, gets a job and is evaluated",
        "stream_frames": "frames each device answers per round",
        "eval_scenes": "held-out test scenes each device is scored on after each round (same questions for every method)",
        "stagger": "device d starts at schedule entry d (a fleet on different domains) instead of all on the first",
        "methods": "the methods compared (cdcca-sim --methods overrides): see \"Methods\" below; "
                   "NAME@R sets a method's stage-2 token ratio",
        "schedule": "one entry per round (a shorter schedule repeats its last entry); see \"schedule entries\"",
        "cloud": "where the cloud's state lives for the run; see \"cloud\"",
        "link": "the emulated device link; see \"link\"",
        "uts_score": "UTS stage 2's token score, one the device computes: vis (VIS, the paper's "
                     "Eq. 3), vis_relative (VIS made scale-free), attention_variance, attention_mass",
        "device": "where the cloud's jobs train: cpu or cuda",
        "checkpoint_dir": "the model family: the pair DIR/teacher (cloud) and DIR (devices)",
    },
    "schedule": {
        "shift": "image shift of the round's frames and test scenes: none, rain, snow, fog, "
                 "brightness, contrast, gaussian_noise, motion_blur, jpeg",
        "severity": "its severity, 1-5 (0 with shift none)",
        "text": "the text shift too: paraphrased and knowledge questions over all classes",
        "continual": "a step of the continual stream (a different shift each round) instead",
    },
    "cloud": {
        "store": "files (one in-process cloud on the embedded stores) or postgresql (a PostgreSQL "
                 "server started for the run, fronts behind nginx, trainers leasing jobs)",
        "fronts": "with postgresql: gRPC fronts behind nginx, 1-16",
        "trainers": "with postgresql: trainer processes leasing jobs, 1-16",
    },
    "link": {
        "up_mbit_s": "uplink bandwidth in Mbit/s (0 = unlimited)",
        "down_mbit_s": "downlink bandwidth in Mbit/s (0 = unlimited)",
        "latency_ms": "one-way latency in ms",
        "loss": "share of segments lost, [0, 1)",
    },
}

# Status-file fields. Keys: cdcca-cloud's top level, "devices.*" the object per device id,
# "uplink_refusals.*" the object per device id; cdcca-device's top level and "linger.*".
STATUS_FIELDS = {
    "cdcca-cloud": {
        "status": "SERVING while the process runs",
        "uptime_s": "seconds since start",
        "role": "all (one process), front or trainer (--role)",
        "registered_devices": "devices in the registry",
        "stored_batches": "uplink batches in the sample log",
        "sample_log_damaged_ranges": "damaged ranges the sample log skipped at open (acked data lost)",
        "sample_log_damaged_bytes": "bytes in those ranges",
        "sample_log_truncated_tail_bytes": "bytes of a torn, never-acked tail cut at open",
        "sample_log_bytes": "bytes the sample log holds",
        "sample_log_deleted_segments": "segment files deleted once every sample in them was consumed",
        "uplink_refused": "uplink batches refused since start, by reason, over all devices",
        "uplink_refusals": "per device id: refused batches by reason (refused) and the batches the device reported dropping (dropped_by_device)",
        "uplink_refusals.refused": "batches of this device refused since start, by reason",
        "uplink_refusals.dropped_by_device": "batches this device dropped because the cloud refused them for good, by reason",
        "jobs_done": "AKD jobs finished (an update committed or withheld)",
        "jobs_failed": "jobs that failed",
        "job_leases_lost": "trainer on PostgreSQL: jobs whose lease expired before the result was committed",
        "devices": "per device id: its mirror and what the device last reported (fields below)",
        "devices.mirror_version": "the mirror's version (0 = the pretrained base)",
        "devices.sample_log_bytes": "bytes of this device's samples in the sample log",
        "devices.quarantined_samples": "samples that can never be used, set aside with a reason (ever, persisted)",
        "devices.last_quarantine_reason": "why the last one was",
        "devices.mirror_digest": "digest of the mirror's trainable set (hex)",
        "devices.consumed_sequence": "highest uplink batch trained on",
        "devices.durable_sequence": "highest uplink sequence stored durably (acked)",
        "devices.device_version": "the version the device last reported applied",
        "devices.device_in_sync": "the device's reported digest equals the mirror's",
        "devices.updates_withheld": "updates the guard withheld for this device since the process started",
        "devices.rollbacks": "rollbacks of this device since the process started",
        "devices.holdout_pool": "held-out samples the guard judges on (0 until the device's first job since the start)",
        "resident_mirrors": "mirrors held in memory (at most --max_resident_mirrors idle ones)",
        "mirror_evictions": "mirrors dropped from memory to their state files",
        "updates_withheld": "updates the guard withheld, all devices",
        "quarantined_samples": "quarantined samples, all devices",
    },
    "cdcca-device": {
        "version": "the model version the device runs",
        "digest": "digest of its trainable set (hex); equals the cloud's mirror_digest when in sync",
        "answered": "frames answered",
        "failed_frames": "frames the model could not answer",
        "kept": "samples that passed UTS stage 1",
        "held_out_samples": "answers uplinked whole for the cloud's update guard",
        "dropped": "samples stage 1 kept that a full uplink queue refused",
        "unsent_samples": "samples kept and answered that could not be made into an uplink sample",
        "queued_batches_total": "batches queued since the program started",
        "waiting_batches": "batches in the durable queue now",
        "acked": "highest batch sequence the cloud acknowledged as durable (its numbering)",
        "uplink_bytes": "payload bytes sent, resends included",
        "dropped_batches": "batches dropped because the cloud refused them for good",
        "dropped_batches_by_reason": "those, by reason",
        "uplink_backoffs": "transient refusals the uplink backed off after",
        "renumbered": "times the queue was renumbered to the cloud's log",
        "updates_applied": "updates applied in place",
        "resyncs": "snapshots loaded, or the pretrained base restored",
        "rollbacks": "rollbacks completed (--rollback)",
        "rejected_updates": "update payloads that failed verification or apply",
        "registered": "registered with the cloud",
        "link_up": "the link thread's last pass reached the cloud",
        "in_sync": "the last ReportApplied matched the cloud's mirror",
        "linger": "once the input ended and the linger is over (--linger_s): how it ended",
        "linger.ended": "drained, deadline, signal or off",
        "linger.seconds": "seconds spent lingering",
        "linger.waiting_batches": "batches left in the durable queue (sent at the next start)",
        "linger.why": "what was not done yet (empty when drained)",
    },
}


def run(argv, check=True):
    return subprocess.run(argv, capture_output=True, text=True, check=check, cwd=ROOT,
                          env=dict(os.environ, TERM="dumb"))


def parse_help(argv):
    """(usage lines, [(flag, default, help)]) of one --help."""
    out = run(argv + ["--help"]).stdout
    head, flags, in_flags = [], [], False
    for line in out.splitlines():
        if line.strip() == "Flags:":
            in_flags = True
            continue
        m = FLAG_LINE.match(line)
        if m:
            flags.append((m.group(1), m.group(3), m.group(2)))
        elif not in_flags and line.strip():
            head.append(line.rstrip())
    if not flags:
        raise SystemExit(f"{' '.join(argv)} --help listed no flags")
    return head, flags


def programs(build):
    found = []
    for name, path in [("cdcca-cloud", "cloud/cdcca-cloud"), ("cdcca-device", "device/cdcca-device"),
                       ("cdcca-sim", "sim/cdcca-sim")]:
        exe = os.path.join(build, path)
        if not os.path.exists(exe):
            raise SystemExit(f"{exe} is not built")
        found.append((name, [exe]))
    tool = os.path.join(build, "sim/cdcca")
    if not os.path.exists(tool):
        raise SystemExit(f"{tool} is not built")
    in_commands = False
    for line in run([tool, "help"]).stdout.splitlines():
        if line.startswith("commands:"):
            in_commands = True
            continue
        m = re.match(r"^  (\S+)\s", line)
        if in_commands and m and m.group(1) != "help":
            found.append((f"cdcca {m.group(1)}", [tool, m.group(1)]))
    return found


def cell(text):
    return str(text).replace("|", "\\|")


# ---- experiment keys ------------------------------------------------------------------------

MINIMAL = {"name": "reference", "methods": ["cd-cca"], "schedule": [{"shift": "fog", "severity": 4}]}
KNOWN = re.compile(r"\(known: ([^)]*)\)")


def refused_keys(sim, experiment):
    """The keys the level holding "zz_reference_probe" knows, from the parser's refusal."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(experiment, f)
        path = f.name
    try:
        err = run([sim, "--experiment", path, "--print_config"], check=False).stderr
    finally:
        os.unlink(path)
    m = KNOWN.search(err)
    if "zz_reference_probe" not in err or not m:
        raise SystemExit(f"cdcca-sim did not refuse the probe key with the known keys: {err}")
    return [k.strip() for k in m.group(1).split(",")]


def known_methods(sim):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(dict(MINIMAL, methods=["zz-reference-probe"]), f)
        path = f.name
    try:
        err = run([sim, "--experiment", path, "--print_config"], check=False).stderr
    finally:
        os.unlink(path)
    m = KNOWN.search(err)
    if not m:
        raise SystemExit(f"cdcca-sim did not list the known methods: {err}")
    return [k.strip() for k in m.group(1).split(",")]


def field_initializers():
    """experiment key -> the initializer of the field sim/experiment.cc reads it into."""
    with open(os.path.join(ROOT, "sim/experiment.cc"), encoding="utf-8") as f:
        cc = f.read()
    with open(os.path.join(ROOT, "sim/experiment.h"), encoding="utf-8") as f:
        header = f.read()
    out = {}
    for key, member in re.findall(r'Read\("(\w+)", &\w+(?:\.\w+)*?\.(\w+)\)', cc):
        decl = re.search(r"^\s*(?:std::string|int64_t|int|bool|double|float)\s+" + member +
                         r"\s*(?:=\s*([^;]+))?;", header, re.M)
        if not decl:
            continue
        value = (decl.group(1) or '""').strip()
        if re.fullmatch(r'-?[0-9.]+|true|false|"[^"]*"', value):
            out[key] = value.strip('"') if value.startswith('"') else value
    return out


def experiment_section(build, flags):
    sim = os.path.join(build, "sim/cdcca-sim")
    probe = "zz_reference_probe"
    levels = [
        ("", "top level", refused_keys(sim, dict(MINIMAL, **{probe: 1}))),
        ("schedule", '"schedule" entries',
         refused_keys(sim, dict(MINIMAL, schedule=[{"shift": "fog", "severity": 4, probe: 1}]))),
        ("cloud", '"cloud"', refused_keys(sim, dict(MINIMAL, cloud={probe: 1}))),
        ("link", '"link"', refused_keys(sim, dict(MINIMAL, link={probe: 1}))),
    ]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(MINIMAL, f)
        path = f.name
    try:
        printed = json.loads(run([sim, "--experiment", path, "--print_config"]).stdout)
    finally:
        os.unlink(path)
    initial = field_initializers()
    lines = []
    for level, title, keys in levels:
        described = HARNESS_KEYS[level]
        missing = [k for k in keys if k not in described and (level or k not in flags)]
        if missing:
            raise SystemExit(f"experiment keys ({title}) without a description in "
                             f"scripts/reference.py HARNESS_KEYS: {', '.join(missing)}")
        stale = [k for k in described if k not in keys]
        if stale:
            raise SystemExit(f"HARNESS_KEYS describes experiment keys ({title}) the parser does "
                             f"not know: {', '.join(stale)}")
        lines += [f"### {title}", "", "| key | default | what it sets |", "|---|---|---|"]
        for k in keys:
            if k in described:
                text = described[k]
            else:
                text = flags[k][0][2]
            if not level and k in printed:
                default = json.dumps(printed[k])
            elif k in initial:
                default = json.dumps(initial[k]) if not re.fullmatch(r"-?[0-9.]+|true|false",
                                                                      initial[k]) else initial[k]
            else:
                default = "-"
            lines.append(f"| `{k}` | `{cell(default)}` | {cell(text)} |")
        lines.append("")
    lines += ["### Methods", "",
              "`" + "`, `".join(known_methods(sim)) + "`; `NAME@R` sets the method's stage-2 "
              "token ratio (`cd-cca@0.25`).", ""]
    return lines


# ---- status fields --------------------------------------------------------------------------

def function_body(text, signature):
    start = text.find(signature)
    if start < 0:
        raise SystemExit(f"no `{signature}` in the source: update scripts/reference.py")
    depth, i = 0, text.index("{", start)
    begin = i
    while True:
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1


def cloud_status_fields():
    with open(os.path.join(ROOT, "cloud/open_cloud.cc"), encoding="utf-8") as f:
        body = function_body(f.read(), "nlohmann::json Cloud::Parts::Status(")
    fields = []

    def add(name):
        if name not in fields:
            fields.append(name)

    nested = {}
    for owner, block in re.findall(r"(devices|refusals)\[id\] = (\{.*?\});", body, re.S):
        nested[owner] = re.findall(r'\{"(\w+)",', block)
        body = body.replace(block, "")
    for name in re.findall(r'\{"(\w+)",|s\["(\w+)"\]', body):
        name = name[0] or name[1]
        add(name)
        if name == "devices":
            for sub in nested.get("devices", []):
                add(f"devices.{sub}")
        if name == "uplink_refusals":
            for sub in nested.get("refusals", []):
                add(f"uplink_refusals.{sub}")
    return fields


def device_status_fields():
    with open(os.path.join(ROOT, "tools/cdcca_device_main.cc"), encoding="utf-8") as f:
        text = f.read()
    status = function_body(text, "std::string StatusJson(")
    linger = function_body(text, "struct LingerOutcome")
    fields = re.findall(r'\\"(\w+)\\":', status)
    fields += [f"linger.{n}" for n in re.findall(r'\\"(\w+)\\":', linger)]
    return fields


def status_section():
    lines = []
    for program, fields, how in [
            ("cdcca-cloud", cloud_status_fields(),
             "`--status_file=F`: rewritten atomically every 2 s. `devices` and `uplink_refusals` "
             "are keyed by device id."),
            ("cdcca-device", device_status_fields(),
             "`--status_file=F`: rewritten atomically about once a second; the same object is "
             "the `status` of the `exit` line on stderr.")]:
        described = STATUS_FIELDS[program]
        missing = [f for f in fields if f not in described]
        stale = [f for f in described if f not in fields]
        if missing or stale:
            raise SystemExit(f"{program} status fields: not described in scripts/reference.py: "
                             f"{missing}; described but not written: {stale}")
        lines += [f"### {program}", "", how, "", "| field | what it holds |", "|---|---|"]
        lines += [f"| `{f}` | {cell(described[f])} |" for f in fields]
        lines.append("")
    return lines


# ---- the document ---------------------------------------------------------------------------

def document(build):
    found = [(name, *parse_help(argv)) for name, argv in programs(build)]
    flags = {}
    for name, _, rows in found:
        for flag, default, text in rows:
            flags.setdefault(flag, []).append((name, default, text))
    lines = [
        "# Reference",
        "",
        "<!-- Generated by scripts/reference.py: do not edit. -->",
        "",
        "Every flag of every program and `cdcca` sub-command, every key of a `cdcca-sim` "
        "experiment file and every field of the programs' status files, generated from the "
        "code:",
        "",
        "```",
        "scripts/reference.py build docs/REFERENCE.md",
        "```",
        "",
        "The test `reference_test` (default suite) fails while this file and the code differ. "
        "What each default was chosen by is in [SETTINGS.md](SETTINGS.md). "
        "`cdcca-cloud` and `cdcca-device` also read their flags from `--config=FILE`, a JSON "
        "object keyed by the flags' names (the command line wins).",
        "",
        "## Programs",
        "",
    ]
    for name, head, rows in found:
        lines += [f"### {name}", ""]
        if head:
            lines += ["```"] + head + ["```", ""]
        lines += ["| flag | default | what it sets |", "|---|---|---|"]
        for flag, default, text in rows:
            lines.append(f"| `--{flag}` | `{cell(default)}` | {cell(text)} |")
        lines.append("")
    lines += ["## Experiment files (`cdcca-sim --experiment FILE`)", "",
              "A JSON object; a key the parser does not know, at any level, is refused with the "
              "keys that level knows. A key named as a program's flag sets what that flag sets; "
              "defaults are those `cdcca-sim --print_config` resolves (the `measured` profile on "
              "`models/small`).", ""]
    lines += experiment_section(build, flags)
    lines += ["## Status files", ""]
    lines += status_section()
    return "\n".join(lines).rstrip("\n") + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the file differs")
    parser.add_argument("build")
    parser.add_argument("doc")
    args = parser.parse_args()
    want = document(os.path.abspath(args.build))
    if args.check:
        have = open(args.doc, encoding="utf-8").read() if os.path.exists(args.doc) else ""
        if have != want:
            sys.stderr.write(f"{args.doc} is out of date with the code: run\n"
                             f"  scripts/reference.py {args.build} {args.doc}\n")
            return 1
        print(f"{args.doc} matches the code")
        return 0
    with open(args.doc, "w", encoding="utf-8") as f:
        f.write(want)
    return 0


if __name__ == "__main__":
    sys.exit(main())
