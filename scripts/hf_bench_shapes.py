#!/usr/bin/env python3
"""Random-weight checkpoints at published shapes, and transformers' speed on them.

Speed does not depend on weight values, and nothing can be downloaded, so the speed
benchmarks of docs/BENCHMARKS.md run on random weights at the shapes of
  llava-1.5-7b              CLIP ViT-L/14-336 + Vicuna/LLaMA-7B
  instructblip-vicuna-7b    EVA ViT-g/14 + Q-Former (32 queries) + Vicuna-7B
  blip2-opt-2.7b            EVA ViT-g/14 + Q-Former (32 queries) + OPT-2.7B
  blip2-flan-t5-xl          EVA ViT-g/14 + Q-Former (32 queries) + Flan-T5-XL (encoder-decoder)
  llava-interleave-qwen-0.5b  SigLIP so400m/14-384 + Qwen2-0.5B
This script builds them (bf16) and times transformers on them: batch 1, one image, a
32-token text prompt, greedy, 64 new tokens; time to first token and decode tokens/s,
eager and SDPA attention; plus the measured HBM bandwidth and the weight-bytes-per-token
limit. With --save DIR it also writes each model as a Hugging Face folder, with the very
inputs transformers got in bench_inputs.safetensors, and with --cdcca BIN runs cdcca's
decode_bench (model/bench/decode_bench.cc) on that folder in the same run (after freeing
transformers' copy), recording its JSON line under "cdcca".

CPU mode (--cpu --load FOLDER) times transformers fp32 on a folder saved before (the
0.5B one) with the saved inputs, and records the process's resident memory.

  python3 scripts/hf_bench_shapes.py --out OUT.json [--models a,b] [--save DIR]
      [--cdcca build-gpu/model/decode_bench] [--keep NAME,...]
  python3 scripts/hf_bench_shapes.py --cpu --load DIR --out OUT.json
scripts/hf_bench_gpu.sh runs the whole comparison on the GPU machine.
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import time

import torch
import transformers

# BLIP-2's and InstructBLIP's vision tower (EVA ViT-g/14 at 224) and Q-Former.
EVA_VIT_G = dict(hidden_size=1408, intermediate_size=6144, num_hidden_layers=39, num_attention_heads=16,
                 image_size=224, patch_size=14)
QFORMER = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
               cross_attention_frequency=2, encoder_hidden_size=1408)

SHAPES = {
    "llava-1.5-7b": dict(kind="llava", vision=dict(type="clip", hidden_size=1024, intermediate_size=4096,
                                                   num_hidden_layers=24, num_attention_heads=16, image_size=336,
                                                   patch_size=14, projection_dim=768, hidden_act="quick_gelu"),
                         text=dict(type="llama", vocab_size=32064, hidden_size=4096, intermediate_size=11008,
                                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                   max_position_embeddings=4096),
                         layer=-2, strategy="default"),
    "instructblip-vicuna-7b": dict(kind="instructblip",
                                   vision=EVA_VIT_G,
                                   qformer=dict(QFORMER, vocab_size=30523),
                                   text=dict(type="llama", vocab_size=32001, hidden_size=4096,
                                             intermediate_size=11008, num_hidden_layers=32,
                                             num_attention_heads=32, num_key_value_heads=32,
                                             max_position_embeddings=2048),
                                   queries=32),
    # BLIP-2 with the language models of its published checkpoints (EVA ViT-g/14, 32 queries).
    "blip2-opt-2.7b": dict(kind="blip2",
                           vision=EVA_VIT_G,
                           qformer=dict(QFORMER, vocab_size=30522),
                           text=dict(type="opt", vocab_size=50272, hidden_size=2560, ffn_dim=10240,
                                     num_hidden_layers=32, num_attention_heads=32,
                                     max_position_embeddings=2048, word_embed_proj_dim=2560,
                                     do_layer_norm_before=True, bos_token_id=2, eos_token_id=50118,
                                     pad_token_id=1),
                           queries=32),
    "blip2-flan-t5-xl": dict(kind="blip2",
                             vision=EVA_VIT_G,
                             qformer=dict(QFORMER, vocab_size=30522),
                             text=dict(type="t5", vocab_size=32128, d_model=2048, d_kv=64, d_ff=5120,
                                       num_layers=24, num_decoder_layers=24, num_heads=32,
                                       feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                       decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
                             queries=32),
    "llava-interleave-qwen-0.5b": dict(kind="llava",
                                       vision=dict(type="siglip", hidden_size=1152, intermediate_size=4304,
                                                   num_hidden_layers=26, num_attention_heads=16, image_size=384,
                                                   patch_size=14),
                                       text=dict(type="qwen2", vocab_size=151646, hidden_size=896,
                                                 intermediate_size=4864, num_hidden_layers=24,
                                                 num_attention_heads=14, num_key_value_heads=2,
                                                 max_position_embeddings=32768, tie_word_embeddings=True),
                                       layer=-1, strategy="full"),
}


def text_config(t):
    t = dict(t)
    kind = t.pop("type")
    return {"qwen2": transformers.Qwen2Config, "opt": transformers.OPTConfig,
            "t5": transformers.T5Config}.get(kind, transformers.LlamaConfig)(**t)


def blip2_class(model_type):
    return (transformers.InstructBlipForConditionalGeneration if model_type == "instructblip"
            else transformers.Blip2ForConditionalGeneration if model_type == "blip-2"
            else transformers.LlavaForConditionalGeneration)


def build(name):
    s = SHAPES[name]
    if s["kind"] == "llava":
        v = dict(s["vision"])
        vtype = v.pop("type")
        vcls = transformers.SiglipVisionConfig if vtype == "siglip" else transformers.CLIPVisionConfig
        vcfg = vcls(**v)
        tcfg = text_config(s["text"])
        cfg = transformers.LlavaConfig(vision_config=vcfg, text_config=tcfg,
                                       image_token_index=tcfg.vocab_size - 1,
                                       vision_feature_layer=s["layer"],
                                       vision_feature_select_strategy=s["strategy"])
        cls = transformers.LlavaForConditionalGeneration
        patches = (vcfg.image_size // vcfg.patch_size) ** 2
        image_tokens = patches + (1 if vtype != "siglip" and s["strategy"] == "full" else 0)
        image_size = vcfg.image_size
    else:
        tcfg = text_config(s["text"])
        config_cls = transformers.Blip2Config if s["kind"] == "blip2" else transformers.InstructBlipConfig
        cfg = config_cls(vision_config=s["vision"], qformer_config=s["qformer"],
                                              text_config=tcfg.to_dict(), num_query_tokens=s["queries"],
                                              image_token_index=tcfg.vocab_size - 1)
        cls = blip2_class(cfg.model_type)
        image_tokens = s["queries"]
        image_size = s["vision"]["image_size"]
    return cfg, cls, image_tokens, image_size


def measure_bandwidth(device):
    n = 1 << 30  # 1 GiB each way
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * n * reps / (time.perf_counter() - start)


def generate_seconds(model, inputs, new_tokens, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def timed_pairs(model, inputs, new_tokens, device, repeats=3):
    """A 1-token and an N-token generate back to back, `repeats` times after a warm-up pair:
    TTFT = median 1-token time, decode = (N - 1) / median of the pairs' differences (the
    same method as cdcca's decode_bench)."""
    ones, fulls, diffs = [], [], []
    for i in range(repeats + 1):
        one = generate_seconds(model, inputs, 1, device)
        full = generate_seconds(model, inputs, new_tokens, device)
        if i:
            ones.append(one)
            fulls.append(full)
            diffs.append(full - one)
    med = lambda v: sorted(v)[len(v) // 2]
    return {"ttft_ms": med(ones) * 1e3, "decode_tokens_per_s": (new_tokens - 1) / max(med(diffs), 1e-9),
            "total_ms": med(fulls) * 1e3}


def rss_bytes(key="VmRSS"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def bench_inputs(cfg, image_tokens, image_size, prompt_tokens, device, dtype):
    """The benchmark's inputs: image tokens then random text, random pixels (seeded)."""
    tcfg = cfg.text_config
    g = torch.Generator().manual_seed(1)
    text = torch.randint(10, tcfg.vocab_size - 2, (1, prompt_tokens), generator=g)
    image = torch.full((1, image_tokens), cfg.image_token_index, dtype=torch.long)
    ids = torch.cat([image, text], 1).to(device)
    pixels = torch.randn(1, 3, image_size, image_size, generator=g).to(device, dtype)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}
    if cfg.model_type == "instructblip":
        q = torch.randint(1000, 2000, (1, 16), generator=g).to(device)
        inputs.update(qformer_input_ids=q, qformer_attention_mask=torch.ones_like(q))
    return inputs


def save_inputs(inputs, path):
    from safetensors.torch import save_file
    tensors = {"input_ids": inputs["input_ids"].cpu().contiguous(),
               "pixel_values": inputs["pixel_values"].float().cpu().contiguous()}
    if "qformer_input_ids" in inputs:
        tensors["qformer_input_ids"] = inputs["qformer_input_ids"].cpu().contiguous()
    save_file(tensors, path)


def load_inputs(path, device, dtype):
    from safetensors.torch import load_file
    t = load_file(path)
    inputs = {"input_ids": t["input_ids"].to(device), "pixel_values": t["pixel_values"].to(device, dtype)}
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    if "qformer_input_ids" in t:
        inputs["qformer_input_ids"] = t["qformer_input_ids"].to(device)
        inputs["qformer_attention_mask"] = torch.ones_like(inputs["qformer_input_ids"])
    return inputs


def run_cdcca(binary, folder, extra, env=None):
    cmd = [binary, "--model", folder] + extra
    print("+", " ".join(f"{k}={v}" for k, v in (env or {}).items()), " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **(env or {})))
    if p.returncode != 0:
        print(p.stderr[-4000:], flush=True)
        return {"error": p.stderr[-2000:], "command": " ".join(cmd)}
    row = json.loads(p.stdout.strip().splitlines()[-1])
    row["command"] = " ".join(cmd)
    return row


def cpu_load(args):
    """transformers fp32 on CPU on a saved folder, with its saved inputs."""
    base_rss = rss_bytes()
    cfg = transformers.AutoConfig.from_pretrained(args.load)
    cls = blip2_class(cfg.model_type)
    model = cls.from_pretrained(args.load, dtype=torch.float32).eval()
    inputs = load_inputs(os.path.join(args.load, "bench_inputs.safetensors"), torch.device("cpu"),
                         torch.float32)
    row = {"folder": args.load, "threads": torch.get_num_threads(),
           "lm_input_tokens": inputs["input_ids"].shape[1], "rss_before_model_bytes": base_rss}
    row["sdpa"] = timed_pairs(model, inputs, args.new_tokens, torch.device("cpu"), args.repeats)
    row["rss_bytes"] = rss_bytes()
    row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"transformers": transformers.__version__, "torch": torch.__version__,
                   "cpu": row}, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--save", default="")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--prompt_tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cdcca", default="", help="cdcca's decode_bench binary, run on each saved folder")
    ap.add_argument("--cdcca_args", default="", help="extra decode_bench flags (space-separated)")
    ap.add_argument("--cdcca_exact_ops", action="store_true",
                    help="also time cdcca's static loop with CDCCA_STATIC_EXACT_OPS=1")
    ap.add_argument("--keep", default="", help="saved folders to keep; the others are deleted after use")
    ap.add_argument("--save_only", action="store_true", help="write the folders, time nothing")
    ap.add_argument("--load", default="", help="with --cpu: time transformers on this saved folder")
    args = ap.parse_args()
    if args.cpu and args.load:
        return cpu_load(args)
    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    results = {"transformers": transformers.__version__, "torch": torch.__version__, "models": {}}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
        results["copy_bandwidth_bytes_per_s"] = measure_bandwidth(device)
    for name in args.models.split(","):
        torch.manual_seed(0)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        cfg, cls, image_tokens, image_size = build(name)
        with torch.device(device):
            model = cls._from_config(cfg, dtype=dtype).eval()
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        lm_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if "language_model" in n or "lm_head" in n)
        inputs = bench_inputs(cfg, image_tokens, image_size, args.prompt_tokens, device, dtype)
        folder = os.path.join(args.save, name) if args.save else ""
        if folder:
            model.save_pretrained(folder)
            save_inputs(inputs, os.path.join(folder, "bench_inputs.safetensors"))
        if args.save_only:
            del model
            continue
        row = {"weight_bytes": weight_bytes, "lm_weight_bytes": lm_bytes,
               "lm_input_tokens": inputs["input_ids"].shape[1]}
        for attn in ["eager", "sdpa"]:
            model.set_attn_implementation(attn) if hasattr(model, "set_attn_implementation") else None
            row[attn] = timed_pairs(model, inputs, args.new_tokens, device, args.repeats)
        if device.type == "cuda":
            row["bandwidth_limit_tokens_per_s"] = results["copy_bandwidth_bytes_per_s"] / lm_bytes
            row["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if folder and args.cdcca:
            extra = ["--device", device.type, "--precision", "bf16" if device.type == "cuda" else "fp32",
                     "--new_tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
            row["cdcca"] = run_cdcca(args.cdcca, folder, extra + args.cdcca_args.split())
            if args.cdcca_exact_ops:  # the static loop with the reference's operations
                row["cdcca_exact_ops"] = run_cdcca(args.cdcca, folder, extra + ["--paths", "static"],
                                                   {"CDCCA_STATIC_EXACT_OPS": "1"})
        if folder and name not in args.keep.split(","):
            shutil.rmtree(folder)
        results["models"][name] = row
        print(name, json.dumps(row), flush=True)
        with open(args.out, "w") as f:  # after each model, so a cut-off run keeps the rest
            json.dump(results, f, indent=1)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
