#!/usr/bin/env python3
"""One AKD job on a LLaVA teacher-student pair as a PyTorch + transformers + peft loop: the
reference that cdcca's akd_bench (distill/bench/akd_bench.cc) is timed against.

  make: random-weight LLaVA folders at published shapes (speed does not depend on weight
        values, and nothing can be downloaded), the student's vision tower copied into the
        teacher (a pair shares its tower), and the job's inputs: the student tower's output
        tokens of random frames ("tokens" [S, N, D], what devices uplink) and each sample's
        prompt ids ("prompt_ids" [S, P]: BOS, the image token, random text).
  run:  the job, the same losses as distill/pair_distiller.cc on the same inputs:
          - per sample, once, --prepare_batch samples a batch (left-padded, as cdcca batches
            them): the teacher's greedy answer (at most --max_answer_tokens, then EOS), and
            teacher-forced on it Q_t (projected image tokens), R_t (hidden state after
            num_layers / 2 layers at the answer positions) and the answer's logits;
          - phi, psi: fp32 linear maps student width -> teacher width, ridge-fitted (lambda
            relative to the mean diagonal of X^T X) on the student's features over the pool;
          - each step, a batch of --batch_size samples (reshuffled each epoch), teacher-forced on
            the teacher's answer: l_ce CE + l_query MSE(LN Q_t, LN phi(Q_s)) + l_repr MSE(LN R_t,
            LN psi(R_s)) + l_kl T^2 KL(teacher || student at temperature T), CE and KL over the
            answer's predictor positions; AdamW on LoRA q/v + LM norms + projector biases +
            phi + psi; weights from configs/distill/akd.json.
        The student is the same folder in bf16 (peft LoRA adapters in bf16 too): the GPU
        machine has no bitsandbytes, so transformers cannot hold an int4 base.
Both print one JSON line with the same keys.

  python3 scripts/hf_akd_reference.py make --out DIR [--teacher llava-1.5-13b]
      [--student llava-1.5-7b] [--samples 64] [--prompt_tokens 40]
  python3 scripts/hf_akd_reference.py run --teacher DIR --student_base DIR --inputs FILE
      [--max_steps 200] [--batch_size 16] [--max_answer_tokens 32] [--lora_rank 8]
      [--lora_alpha 16] [--jobs 1] [--prepare_batch 0]
run takes akd_bench's flags under its names (the programs' names, docs/SETTINGS.md), so one
argument list drives both (scripts/hf_akd_gpu.sh).
"""
import argparse
import json
import os
import random
import time

import torch
import torch.nn.functional as F
import transformers

# LLaVA-1.5 (llava-hf): CLIP ViT-L/14-336, feature layer -2 without CLS (576 tokens), Vicuna.
CLIP_L_336 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu")
SHAPES = {
    "llava-1.5-13b": dict(vision=CLIP_L_336,
                          text=dict(vocab_size=32064, hidden_size=5120, intermediate_size=13824,
                                    num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                                    max_position_embeddings=4096)),
    "llava-1.5-7b": dict(vision=CLIP_L_336,
                         text=dict(vocab_size=32064, hidden_size=4096, intermediate_size=11008,
                                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                   max_position_embeddings=4096)),
    # A smoke test of the whole comparison in seconds.
    "tiny-teacher": dict(vision=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, image_size=56, patch_size=14, projection_dim=32,
                                     hidden_act="quick_gelu"),
                         text=dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)),
    "tiny-student": dict(vision=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, image_size=56, patch_size=14, projection_dim=32,
                                     hidden_act="quick_gelu"),
                         text=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)),
}


def llava_config(name):
    s = SHAPES[name]
    text = transformers.LlamaConfig(**s["text"])
    return transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(**s["vision"]), text_config=text,
                                    image_token_index=32000 if text.vocab_size > 32000 else text.vocab_size - 1,
                                    vision_feature_layer=-2, vision_feature_select_strategy="default")


def make(args):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    os.makedirs(args.out, exist_ok=True)
    scfg = llava_config(args.student)
    with torch.device(dev):
        student = transformers.LlavaForConditionalGeneration._from_config(scfg, dtype=torch.bfloat16).eval()
    t0 = time.perf_counter()
    student.save_pretrained(os.path.join(args.out, "student"))
    print(f"student {args.student} saved in {time.perf_counter() - t0:.0f} s", flush=True)
    # The inputs: the student tower's tokens of random frames, and random prompts.
    g = torch.Generator().manual_seed(1)
    size = scfg.vision_config.image_size
    tokens = []
    with torch.no_grad():
        for i in range(0, args.samples, 16):
            n = min(16, args.samples - i)
            pixels = torch.randn(n, 3, size, size, generator=g).to(dev, torch.bfloat16)
            out = student.model.vision_tower(pixels, output_hidden_states=True)
            tokens.append(out.hidden_states[-2][:, 1:].float().cpu())
    tokens = torch.cat(tokens)
    vocab = scfg.text_config.vocab_size
    text = torch.randint(10, min(vocab, 32000) - 1, (args.samples, args.prompt_tokens - 2), generator=g)
    bos = torch.full((args.samples, 1), scfg.text_config.bos_token_id or 1)
    image = torch.full((args.samples, 1), scfg.image_token_index)
    prompt_ids = torch.cat([bos, image, text], 1)
    from safetensors.torch import save_file
    save_file({"tokens": tokens.contiguous(), "prompt_ids": prompt_ids.contiguous()},
              os.path.join(args.out, "inputs.safetensors"))
    tower = {k: v.clone() for k, v in student.model.vision_tower.state_dict().items()}
    del student
    torch.cuda.empty_cache()
    tcfg = llava_config(args.teacher)
    with torch.device(dev):
        teacher = transformers.LlavaForConditionalGeneration._from_config(tcfg, dtype=torch.bfloat16).eval()
    teacher.model.vision_tower.load_state_dict(tower)
    t0 = time.perf_counter()
    teacher.save_pretrained(os.path.join(args.out, "teacher"))
    print(f"teacher {args.teacher} saved in {time.perf_counter() - t0:.0f} s", flush=True)


# ---------------------------------------------------------------------------------------------
# The job.


def layer_norm(x):
    return F.layer_norm(x, (x.shape[-1],), eps=1e-5)


def feature_mse(teacher, student, mask):
    """distill/losses.cc FeatureMse with normalize: masked mean over positions of the per-position
    mean squared difference of the layer-normed features."""
    per = (layer_norm(teacher) - layer_norm(student)).pow(2).mean(-1)
    w = mask.float()
    return (per * w).sum() / w.sum().clamp_min(1.0)


def ridge_fit(x, y, lam, linear):
    """distill/akd.cc RidgeFit, in float64."""
    xd, yd = x.double(), y.double()
    xa = torch.cat([xd, torch.ones(xd.shape[0], 1, dtype=xd.dtype, device=xd.device)], 1)
    gram = xa.t() @ xa
    gram = gram + torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device) * (lam * gram.diagonal().mean())
    w = torch.linalg.solve(gram, xa.t() @ yd)
    with torch.no_grad():
        linear.weight.copy_(w[:-1].t().float())
        linear.bias.copy_(w[-1].float())


class Side:
    """A LLaVA model fed the uplinked tower tokens in place of its own tower."""

    def __init__(self, model):
        self.model = model
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.llava = inner.model
        self.image_token = inner.config.image_token_index
        self.dtype = next(self.llava.language_model.parameters()).dtype
        self.capture = inner.config.text_config.num_hidden_layers // 2

    def expand(self, ids, n):
        out = []
        for i in ids:
            out.extend([i] * n if i == self.image_token else [i])
        return out

    def embed(self, ids, tokens):
        """The LM's input embeddings with the projected tower tokens at the image positions,
        and the projected tokens."""
        projected = self.llava.multi_modal_projector(tokens.to(self.dtype))
        embeds = self.llava.get_input_embeddings()(ids)
        slots = (ids == self.image_token).unsqueeze(-1).expand_as(embeds)
        return embeds.masked_scatter(slots, projected.to(embeds.dtype)), projected

    def forward(self, ids, mask, positions, tokens, hidden=True):
        """logits [B, T, V], R [B, T, H] (or None), Q [B, N, H] fp32."""
        embeds, projected = self.embed(ids, tokens)
        out = self.model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                         output_hidden_states=hidden, use_cache=False)
        r = out.hidden_states[self.capture] if hidden else None
        return out.logits, r, projected.float()


def left_pad(rows, dev):
    """Rows of ids left-padded: ids, mask and positions [B, T] (padding at position 1, as
    transformers' generate numbers a left-padded batch)."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - len(r):] = torch.tensor(r)
        mask[b, width - len(r):] = 1
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    return ids.to(dev), mask.to(dev), positions.to(dev)


def greedy(side, prompts, tokens, max_new, eos):
    """The teacher's answers to a batch of prompts (left-padded): greedy, KV-cached, each row
    ending after its EOS; the batch stops when every row has."""
    dev = tokens.device
    ids, mask, positions = left_pad(prompts, dev)
    embeds, _ = side.embed(ids, tokens)
    out = side.model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=True)
    answers = [[] for _ in prompts]
    done = [False] * len(prompts)
    last = positions[:, -1:]
    for _ in range(max_new):
        nxt = out.logits[:, -1].argmax(-1)
        for b, t in enumerate(nxt.tolist()):
            if not done[b]:
                answers[b].append(t)
                done[b] = t in eos
        if all(done):
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        last = last + 1
        out = side.model(input_ids=nxt.unsqueeze(1), attention_mask=mask, position_ids=last,
                         past_key_values=out.past_key_values, use_cache=True)
    return answers


def run(args):
    dev = torch.device("cuda")
    cfg = json.load(open(args.distill_config))
    learner = cfg["learner"]
    torch.manual_seed(args.seed)
    t_load = time.perf_counter()
    cls = transformers.LlavaForConditionalGeneration
    teacher = cls.from_pretrained(args.teacher, dtype=torch.bfloat16, attn_implementation="sdpa",
                                  device_map={"": 0}).eval()
    student = cls.from_pretrained(args.student_base, dtype=torch.bfloat16, attn_implementation="sdpa",
                                  device_map={"": 0})
    import peft
    lora = peft.LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0, bias="none",
                           target_modules=r".*language_model.*\.(q_proj|v_proj)")
    student = peft.get_peft_model(student, lora, autocast_adapter_dtype=False)
    # cdcca's trainable set beyond LoRA: the LM's norms and the projector's biases.
    for name, p in student.named_parameters():
        if ("language_model" in name and "norm" in name) or ("multi_modal_projector" in name and name.endswith("bias")):
            p.requires_grad_(True)
    student.eval()  # dropout off, as cdcca trains (student_dropout false)
    torch.cuda.synchronize()
    load_seconds = time.perf_counter() - t_load
    from safetensors.torch import load_file
    inputs = load_file(args.inputs)
    tokens, prompt_ids = inputs["tokens"], inputs["prompt_ids"]
    T, S = Side(teacher), Side(student)
    eos = [teacher.config.text_config.eos_token_id or 2]
    n_image = tokens.shape[1]

    def one_job(tokens, prompt_ids):
        """One device's job from the pretrained trainable set, on its samples."""
        # Preparation: the teacher's answers and targets, then the ridge fit.
        torch.cuda.synchronize()
        t_job = time.perf_counter()
        pool = []
        chunk = args.prepare_batch or 2 * args.batch_size
        # The preparation's phases, synchronized as akd_bench times them (--phase_steps > 0).
        prepare_phases = {}
        prep_mark = [t_job]

        def phase(name):
            if args.phase_steps <= 0:
                return
            torch.cuda.synchronize()
            now = time.perf_counter()
            prepare_phases[name] = prepare_phases.get(name, 0.0) + now - prep_mark[0]
            prep_mark[0] = now

        with torch.no_grad():
            for begin in range(0, tokens.shape[0], chunk):
                rows = range(begin, min(tokens.shape[0], begin + chunk))
                tok = tokens[begin:begin + len(rows)].to(dev)
                prompts = [T.expand(prompt_ids[i].tolist(), n_image) for i in rows]
                answers = greedy(T, prompts, tok, args.max_answer_tokens, eos)
                phase("greedy")
                for answer in answers:
                    while answer and answer[-1] in eos:
                        answer.pop()
                    answer.append(eos[0])
                full, mask, positions = left_pad([p + a for p, a in zip(prompts, answers)], dev)
                logits, r, q = T.forward(full, mask, positions, tok)
                width = full.shape[1]
                for b, (prompt, answer) in enumerate(zip(prompts, answers)):
                    a = len(answer)
                    pool.append(dict(tokens=tok[b:b + 1], prompt=prompt, answer=answer, q=q[b],
                                     r=r[b, width - a:].float(), logits=logits[b, width - a - 1:width - 1].float()))
                phase("forced")

        def collate(rows):
            width = max(len(pool[i]["prompt"]) + len(pool[i]["answer"]) for i in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            targets = torch.full((len(rows), width), -1, dtype=torch.long)
            for b, i in enumerate(rows):
                row = pool[i]["prompt"] + pool[i]["answer"]
                a = len(pool[i]["answer"])
                ids[b, width - len(row):] = torch.tensor(row)
                mask[b, width - len(row):] = 1
                targets[b, width - a - 1:width - 1] = torch.tensor(pool[i]["answer"])
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
            toks = torch.cat([pool[i]["tokens"] for i in rows])
            return ids.to(dev), mask.to(dev), positions.to(dev), targets.to(dev), toks

        def student_repr(r, rows, width):
            p = max(len(pool[i]["answer"]) for i in rows)
            out = torch.zeros(len(rows), p, r.shape[-1], device=dev)
            mask = torch.zeros(len(rows), p, dtype=torch.bool, device=dev)
            for b, i in enumerate(rows):
                a = len(pool[i]["answer"])
                out[b, :a] = r[b, width - a:].float()
                mask[b, :a] = True
            return out, mask

        def stack(rows, key):
            p = max(pool[i][key].shape[0] for i in rows)
            return torch.stack([F.pad(pool[i][key], (0, 0, 0, p - pool[i][key].shape[0])) for i in rows])

        uses_features = learner["feature_loss"] != "none" and (learner["l_query"] > 0 or learner["l_repr"] > 0)
        phi = psi = None
        if uses_features:
            hs = student.get_base_model().config.text_config.hidden_size
            ht = teacher.config.text_config.hidden_size
            phi = torch.nn.Linear(hs, ht).to(dev)
            psi = torch.nn.Linear(hs, ht).to(dev)
            if learner.get("ridge_init", True):
                qs, qt, rs, rt = [], [], [], []
                with torch.no_grad():
                    for begin in range(0, len(pool), args.batch_size):
                        rows = list(range(begin, min(len(pool), begin + args.batch_size)))
                        ids, mask, positions, _, toks = collate(rows)
                        _, r, q = S.forward(ids, mask, positions, toks)
                        qs.append(q.reshape(-1, q.shape[-1]))
                        q_t = stack(rows, "q")
                        qt.append(q_t.reshape(-1, q_t.shape[-1]))
                        sr, m = student_repr(r, rows, ids.shape[1])
                        rs.append(sr[m])
                        rt.append(stack(rows, "r")[m])
                ridge_fit(torch.cat(qs), layer_norm(torch.cat(qt)), learner["ridge_lambda"], phi)
                ridge_fit(torch.cat(rs), layer_norm(torch.cat(rt)), learner["ridge_lambda"], psi)
        phase("fit")
        torch.cuda.synchronize()
        prepare_seconds = time.perf_counter() - t_job

        params = [p for p in student.parameters() if p.requires_grad]
        trainable = sum(p.numel() for p in params)
        if uses_features:
            params += list(phi.parameters()) + list(psi.parameters())
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
        rng = random.Random(args.seed)
        order, cursor = list(range(len(pool))), len(pool)
        history = {}
        temp = learner["temperature"]
        t_train = time.perf_counter()
        phases, timed_steps, phase_bytes = {}, 0, {}
        step_seconds, step_start = [], t_train
        for step in range(args.max_steps):
            # Names the step in a --trace, as akd_bench's trainer does.
            step_scope = torch.profiler.record_function("cdcca::train_step")
            step_scope.__enter__()
            # The last --phase_steps steps timed phase by phase, synchronized as akd_bench does.
            timed = step >= args.max_steps - args.phase_steps
            if timed:
                torch.cuda.synchronize()
                timed_steps += 1
            last = [time.perf_counter()]

            def mark(name):
                if timed:
                    torch.cuda.synchronize()
                    now = time.perf_counter()
                    phases[name] = phases.get(name, 0.0) + now - last[0]
                    phase_bytes[name] = max(phase_bytes.get(name, 0), torch.cuda.memory_allocated())
                    last[0] = now

            rows = []
            while len(rows) < min(args.batch_size, len(pool)):
                if cursor == len(order):
                    rng.shuffle(order)
                    cursor = 0
                rows.append(order[cursor])
                cursor += 1
            ids, mask, positions, targets, toks = collate(rows)
            mark("batch")
            logits, r, q = S.forward(ids, mask, positions, toks)
            mark("forward")
            pred = targets >= 0
            sel = logits[pred].float()
            ce = F.cross_entropy(sel, targets[pred])
            terms = {"ce": ce}
            total = learner["l_ce"] * ce
            if uses_features and learner["l_query"] > 0:
                terms["query"] = feature_mse(stack(rows, "q"), phi(q), torch.ones(q.shape[:2], device=dev))
                total = total + learner["l_query"] * terms["query"]
            if uses_features and learner["l_repr"] > 0:
                sr, m = student_repr(r, rows, ids.shape[1])
                terms["repr"] = feature_mse(stack(rows, "r"), psi(sr), m)
                total = total + learner["l_repr"] * terms["repr"]
            if learner["l_kl"] > 0:
                tl = torch.cat([pool[i]["logits"] for i in rows])
                lt = F.log_softmax(tl / temp, -1)
                ls = F.log_softmax(sel / temp, -1)
                terms["kl"] = temp * temp * (lt.exp() * (lt - ls)).sum(-1).mean()
                total = total + learner["l_kl"] * terms["kl"]
            terms = {"total": total, **terms}
            mark("losses")
            opt.zero_grad(set_to_none=True)
            total.backward()
            mark("backward")
            opt.step()
            mark("optimizer")
            for k, v in terms.items():
                history.setdefault(k, []).append(v.item())
            # Each step's wall seconds up to its terms read back (which waits for the GPU).
            step_scope.__exit__(None, None, None)
            now = time.perf_counter()
            step_seconds.append(now - step_start)
            step_start = now
        torch.cuda.synchronize()
        train_seconds = time.perf_counter() - t_train
        job_seconds = time.perf_counter() - t_job
        seen = args.max_steps * min(args.batch_size, len(pool))
        return dict(pool=pool, trainable=trainable, history=history, phases=phases, phase_bytes=phase_bytes,
                    timed_steps=timed_steps, prepare_seconds=prepare_seconds,
                    prepare_phases=prepare_phases, train_seconds=train_seconds, job_seconds=job_seconds, seen=seen,
                    step_seconds=step_seconds)

    # A fleet's round (--jobs K): K devices' jobs over the one loaded pair, as a competent
    # user runs them with peft: the model loaded once, each job starting from the
    # pretrained trainable set (its LoRA and norms copied back), with its own optimizer and
    # its samples (the inputs rotated by K-th parts, as akd_bench --jobs), one after another.
    initial = {n: p.detach().clone() for n, p in student.named_parameters() if p.requires_grad}
    torch.cuda.synchronize()
    resident_bytes = torch.cuda.memory_allocated()
    profiler = None
    if args.trace:
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        profiler = torch.profiler.profile(activities=acts)
        profiler.__enter__()
    fleet_start = time.perf_counter()
    jobs = []
    for d in range(args.jobs):
        with torch.no_grad():
            for n, p in student.named_parameters():
                if n in initial:
                    p.copy_(initial[n])
        shift = d * tokens.shape[0] // args.jobs
        jobs.append(one_job(torch.roll(tokens, -shift, 0), torch.roll(prompt_ids, -shift, 0)))
    torch.cuda.synchronize()
    if profiler is not None:
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(args.trace)
    fleet_seconds = time.perf_counter() - fleet_start
    first = jobs[0]
    pool, trainable, history, phases = first["pool"], first["trainable"], first["history"], first["phases"]
    timed_steps, prepare_seconds = first["timed_steps"], first["prepare_seconds"]
    train_seconds = first["train_seconds"]
    # As akd_bench: the job figures cover every device's job, the others are the first's.
    seen = sum(j["seen"] for j in jobs)
    job_seconds = first["job_seconds"] if args.jobs == 1 else fleet_seconds
    summary = {k: {"first": v[0], "last": sum(v[-10:]) / len(v[-10:]), "mean": sum(v) / len(v)}
               for k, v in history.items()}
    row = {"implementation": "transformers+peft", "transformers": transformers.__version__,
           "peft": peft.__version__, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
           "teacher_precision": "bf16", "student_precision": "bf16", "samples": len(pool),
           "visual_tokens": n_image, "prompt_tokens": prompt_ids.shape[1],
           "mean_answer_tokens": sum(len(x["answer"]) - 1 for x in pool) / len(pool),
           "trainable_parameters": trainable, "steps": args.max_steps, "batch": args.batch_size,
           "prepare_batch": args.prepare_batch or 2 * args.batch_size,
           "kl_used": learner["l_kl"] > 0, "load_seconds": load_seconds, "prepare_seconds": prepare_seconds,
           "train_seconds": train_seconds, "job_seconds": job_seconds,
           "train_samples_per_second": first["seen"] / train_seconds, "job_samples_per_second": seen / job_seconds,
           "terms": summary, "phase_timed_steps": timed_steps,
           "phases_ms_per_step": {k: 1000 * v / max(1, timed_steps) for k, v in sorted(phases.items())},
           "phase_allocated_bytes": first["phase_bytes"],
           "prepare_phases_seconds": first["prepare_phases"], "step_seconds": first["step_seconds"],
           "device_jobs": args.jobs, "device_jobs_per_hour": args.jobs * 3600.0 / job_seconds,
           "peak_gpu_allocated_bytes": torch.cuda.max_memory_allocated(),
           "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved(),
           "gpu_allocated_before_jobs_bytes": resident_bytes}
    print(json.dumps(row), flush=True)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    m.add_argument("--teacher", default="llava-1.5-13b", choices=list(SHAPES))
    m.add_argument("--student", default="llava-1.5-7b", choices=list(SHAPES))
    m.add_argument("--samples", type=int, default=64)
    m.add_argument("--prompt_tokens", type=int, default=40)
    r = sub.add_parser("run")
    r.add_argument("--teacher", required=True)
    r.add_argument("--student_base", required=True)
    r.add_argument("--inputs", required=True)
    r.add_argument("--distill_config", default="configs/distill/akd.json")
    r.add_argument("--max_steps", type=int, default=200)
    r.add_argument("--batch_size", type=int, default=16)
    r.add_argument("--max_answer_tokens", type=int, default=32)
    r.add_argument("--lora_rank", type=int, default=8)
    r.add_argument("--lora_alpha", type=float, default=16.0)
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--prepare_batch", type=int, default=0,
                   help="samples the teacher labels in one batch (0 = twice --batch_size, as cdcca; 1 = one at a time)")
    r.add_argument("--jobs", type=int, default=1,
                   help="devices' jobs over the one loaded pair, one after another (a fleet's round)")
    r.add_argument("--trace", default="",
                   help="a Chrome trace of the jobs written here (torch.profiler: host operators and CUDA "
                        "kernels, each training step named cdcca::train_step), as akd_bench --trace")
    r.add_argument("--phase_steps", type=int, default=0,
                   help="the last N steps timed phase by phase, synchronized as akd_bench --phase_steps")
    args = ap.parse_args()
    make(args) if args.mode == "make" else run(args)


if __name__ == "__main__":
    main()
