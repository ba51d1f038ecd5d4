#!/usr/bin/env python3
"""Checks that a `cdcca export-adapter` folder makes transformers + peft answer as cdcca's
adapted student does.

For each family folder that scripts/peft_check.sh wrote: load the base with transformers
(float32, eager attention), load non_lora.safetensors into it (every tensor must be a
parameter of the model), wrap it with peft.PeftModel.from_pretrained(peft/), generate
greedily on the same image and prompt, and compare with cdcca's adapted answer: the greedy
tokens must be equal, and the first step's logits are compared (max |diff|). The base
model's answer is compared the same way, to show the adapter changed what it answers.

  python3 scripts/peft_check.py build/peft_check   -> prints a table, writes report.json
Exits 1 when any family's adapted tokens differ.
"""
import json
import os
import sys

import safetensors.torch
import torch
import transformers
import peft
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "hf")
CLASSES = {
    "llava": transformers.LlavaForConditionalGeneration,
    "blip-2": transformers.Blip2ForConditionalGeneration,
    "instructblip": transformers.InstructBlipForConditionalGeneration,
}


def answer(model, processor, image, prompt):
    inputs = processor(images=image, text=prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False, num_beams=1,
                             output_logits=True, return_dict_in_generate=True)
    n = inputs["input_ids"].shape[1]
    seq = out.sequences[0]
    tokens = seq[n:].tolist() if seq.shape[0] > n else seq.tolist()
    return tokens, out.logits[0][0].float()


def check(fam_dir, fam):
    base_dir = os.path.join(FIXTURES, "models", fam)
    with open(os.path.join(base_dir, "config.json")) as f:
        cls = CLASSES[json.load(f)["model_type"]]
    with open(os.path.join(fam_dir, "prompt.txt")) as f:
        prompt = f.read().rstrip("\n")
    processor = transformers.AutoProcessor.from_pretrained(base_dir)
    model = cls.from_pretrained(base_dir, attn_implementation="eager", dtype=torch.float32).eval()
    extra = safetensors.torch.load_file(os.path.join(fam_dir, "peft", "non_lora.safetensors"))
    result = model.load_state_dict(extra, strict=False)
    if result.unexpected_keys:
        raise RuntimeError(f"{fam}: non_lora tensors the model lacks: {result.unexpected_keys}")
    adapted = peft.PeftModel.from_pretrained(model, os.path.join(fam_dir, "peft")).eval()
    lora_modules = sum(1 for n, _ in adapted.named_modules() if n.endswith("lora_A.default"))
    base = cls.from_pretrained(base_dir, attn_implementation="eager", dtype=torch.float32).eval()
    rows = []
    for img in ("gradient_97x61", "noise_123x77"):
        image = Image.open(os.path.join(FIXTURES, "images", img + ".png"))
        for arm, m in (("adapted", adapted), ("base", base)):
            with open(os.path.join(fam_dir, f"{arm}_{img}.json")) as f:
                want = json.load(f)
            tokens, logits = answer(m, processor, image, prompt)
            diff = float((logits - torch.tensor(want["first_logits"])).abs().max())
            rows.append({"family": fam, "image": img, "arm": arm, "cdcca_tokens": want["tokens"],
                         "transformers_tokens": tokens, "equal": tokens == want["tokens"],
                         "first_logits_max_abs_diff": diff})
    return rows, lora_modules, len(extra)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build", "peft_check")
    report = {"transformers": transformers.__version__, "peft": peft.__version__,
              "torch": torch.__version__, "families": {}}
    ok = True
    for fam in sorted(os.listdir(out)):
        fam_dir = os.path.join(out, fam)
        if not os.path.isdir(os.path.join(fam_dir, "peft")):
            continue
        rows, lora_modules, extra = check(fam_dir, fam)
        report["families"][fam] = {"lora_modules": lora_modules, "non_lora_tensors": extra,
                                   "rows": rows}
        for r in rows:
            print(f"{fam:20s} {r['image']:15s} {r['arm']:8s} equal={r['equal']} "
                  f"max|dlogit|={r['first_logits_max_abs_diff']:.2e} cdcca={r['cdcca_tokens']} "
                  f"transformers={r['transformers_tokens']}")
            if r["arm"] == "adapted" and not r["equal"]:
                ok = False
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print("all adapted answers equal" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
