#!/usr/bin/env python3
"""Random-weight checkpoints at published shapes, and transformers' speed on them.

Speed does not depend on weight values, and nothing can be downloaded, so the speed
benchmarks of issue "Real MLLMs" run on random weights at the shapes of
  llava-1.5-7b              CLIP ViT-L/14-336 + Vicuna/LLaMA-7B
  instructblip-vicuna-7b    EVA ViT-g/14 + Q-Former (32 queries) + Vicuna-7B
  llava-interleave-qwen-0.5b  SigLIP so400m/14-384 + Qwen2-0.5B
This script builds them (bf16) and times transformers on them: batch 1, one image, a
32-token text prompt, greedy, 64 new tokens; time to first token and decode tokens/s,
eager and SDPA attention; plus the measured HBM bandwidth and the weight-bytes-per-token
limit. With --save DIR it also writes each model as a Hugging Face folder for cdcca's own
benchmark to load in the same run.

  python3 scripts/hf_bench_shapes.py --out OUT.json [--models a,b] [--save DIR] [--cpu]
"""
import argparse
import json
import os
import time

import torch
import transformers

SHAPES = {
    "llava-1.5-7b": dict(kind="llava", vision=dict(type="clip", hidden_size=1024, intermediate_size=4096,
                                                   num_hidden_layers=24, num_attention_heads=16, image_size=336,
                                                   patch_size=14, projection_dim=768, hidden_act="quick_gelu"),
                         text=dict(type="llama", vocab_size=32064, hidden_size=4096, intermediate_size=11008,
                                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                   max_position_embeddings=4096),
                         layer=-2, strategy="default"),
    "instructblip-vicuna-7b": dict(kind="instructblip",
                                   vision=dict(hidden_size=1408, intermediate_size=6144, num_hidden_layers=39,
                                               num_attention_heads=16, image_size=224, patch_size=14),
                                   qformer=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                                intermediate_size=3072, cross_attention_frequency=2,
                                                encoder_hidden_size=1408, vocab_size=30523),
                                   text=dict(type="llama", vocab_size=32001, hidden_size=4096,
                                             intermediate_size=11008, num_hidden_layers=32,
                                             num_attention_heads=32, num_key_value_heads=32,
                                             max_position_embeddings=2048),
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
    return (transformers.Qwen2Config if kind == "qwen2" else transformers.LlamaConfig)(**t)


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
        cfg = transformers.InstructBlipConfig(vision_config=s["vision"], qformer_config=s["qformer"],
                                              text_config=tcfg.to_dict(), num_query_tokens=s["queries"],
                                              image_token_index=tcfg.vocab_size - 1)
        cls = transformers.InstructBlipForConditionalGeneration
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


def timed_generate(model, inputs, new_tokens, device, repeats=3):
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times[1:])[len(times[1:]) // 2]  # median after one warm-up


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--save", default="")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--prompt_tokens", type=int, default=32)
    args = ap.parse_args()
    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    results = {"transformers": transformers.__version__, "torch": torch.__version__, "models": {}}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
        results["copy_bandwidth_bytes_per_s"] = measure_bandwidth(device)
    for name in args.models.split(","):
        torch.manual_seed(0)
        cfg, cls, image_tokens, image_size = build(name)
        with torch.device(device):
            model = cls._from_config(cfg, dtype=dtype).eval()
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        lm_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if "language_model" in n or "lm_head" in n)
        if args.save:
            model.save_pretrained(os.path.join(args.save, name))
        tcfg = cfg.text_config
        g = torch.Generator().manual_seed(1)
        text = torch.randint(10, tcfg.vocab_size - 2, (1, args.prompt_tokens), generator=g)
        image = torch.full((1, image_tokens), cfg.image_token_index, dtype=torch.long)
        ids = torch.cat([image, text], 1).to(device)
        pixels = torch.randn(1, 3, image_size, image_size, generator=g).to(device, dtype)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}
        if cfg.model_type == "instructblip":
            q = torch.randint(1000, 2000, (1, 16), generator=g).to(device)
            inputs.update(qformer_input_ids=q, qformer_attention_mask=torch.ones_like(q))
        row = {"weight_bytes": weight_bytes, "lm_weight_bytes": lm_bytes, "lm_input_tokens": ids.shape[1]}
        for attn in ["eager", "sdpa"]:
            model.set_attn_implementation(attn) if hasattr(model, "set_attn_implementation") else None
            ttft = timed_generate(model, inputs, 1, device)
            full = timed_generate(model, inputs, args.new_tokens, device)
            decode = (args.new_tokens - 1) / max(full - ttft, 1e-9)
            row[attn] = {"ttft_ms": ttft * 1e3, "decode_tokens_per_s": decode, "total_ms": full * 1e3}
        if device.type == "cuda":
            row["bandwidth_limit_tokens_per_s"] = results["copy_bandwidth_bytes_per_s"] / lm_bytes
            row["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        results["models"][name] = row
        print(name, json.dumps(row), flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
