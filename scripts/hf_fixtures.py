#!/usr/bin/env python3
"""Reference fixtures for cdcca's Hugging Face parity tests.

Builds tiny random checkpoints of every supported family and variant, trains small
tokenizers of each kind, writes image-processor settings, and records what transformers
computes on them: input ids, full-vocabulary first-step logits, greedy tokens, decoded
text, pixel values and tokenizer ids. cdcca's tests compare against these on CPU in CI.

Run where transformers 5.x, tokenizers, sentencepiece, safetensors and torch are
installed (the GPU machine; nothing is downloaded):
    python3 scripts/hf_fixtures.py --out tests/fixtures/hf
Everything is seeded: a rerun with the same library versions writes the same files.
Layout: tests/fixtures/hf/README.md (written by this script).

Check mode: `python3 scripts/hf_fixtures.py --check_family DIR [DIR ...]` loads a folder that
cdcca wrote for one of its own model families (Blip2ForConditionalGeneration or
LlavaForConditionalGeneration by config.json's model_type, a WordLevel tokenizer.json) and
compares transformers' greedy tokens and first-step logits with the answers cdcca recorded
there (cdcca_expected.json, cdcca_pixels.safetensors); for a LLaVA family also that its
processor (chat template, tokenizer, image processor) gives the recorded prompt, ids and
pixel values. Exits 1 on a difference. E.g. tests/fixtures/family/blip2_family_tiny,
models/llava-small.
"""
import argparse
import copy
import json
import os
import random
import shutil
import sys

import numpy as np
import torch
from PIL import Image

import safetensors.torch
import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
import transformers

OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Text the tokenizers are trained on: English-like phrases with the words the prompts use,
# some other scripts, digits and punctuation.
TRAIN_WORDS = ("the a an what is in picture photo image color colour shirt dog cat red green blue "
               "yellow black white how many are there question answer user assistant describe shown "
               "left right top bottom of on under near car tree house person people sky water "
               "it's they're we'll I'd don't can't won't hello world numbers and with for this that "
               "café naïve résumé über straße Ελληνικά русский текст 中文 字符 测试").split()
TRAIN_EXTRA = ["USER: <image>\nWhat is shown? ASSISTANT:", "Question: what color is it? Answer:",
               "1 2 3 10 42 100 2024 3.14 1,000", "!!! ??? ... ;; :) (x) [y] {z}", "\t\ttabs\n\nnewlines"]

# The corpus every tokenizer is checked on: Unicode, digits, whitespace runs, newlines.
TOKENIZER_CASES = [
    "Hello world",
    "what is in the picture?",
    "  leading spaces",
    "trailing spaces   ",
    "multiple   spaces\tand\ttabs",
    "line1\nline2\n\nline4\n",
    "\r\n windows newline\r\n",
    "Numbers 1234567 and 3.14159, 2024-11-24: 1,000,000",
    "Ünïcödé café naïve résumé Straße",
    "Ελληνικά и русский текст",
    "中文字符测试，标点。",
    "emoji 😀👍🏽 mixed 🇫🇷",
    "it's they're we'll I'd DON'T",
    "CamelCaseWordsAndALLCAPS snake_case_words",
    "USER: <image>\nWhat color is the shirt? ASSISTANT:",
    "punctuation!!! ??? ... ;;; :) (parens) [brackets] {braces} @#$%^&*",
    "",
    " ",
    "x" * 40,
    "combining e\u0301 and precomposed \u00e9, ligature \ufb01, fullwidth \uff21\uff42",
]


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def training_corpus(n=3000, seed=0):
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        k = rng.randint(3, 12)
        words = [rng.choice(TRAIN_WORDS) for _ in range(k)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        sep = rng.choice([" ", " ", " ", "  ", "\n", ", "])
        lines.append(sep.join(words) + rng.choice([".", "?", "!", "", ":"]))
    lines.extend(TRAIN_EXTRA * 20)
    return lines


def fast_tokenizer_class():
    for name in ("PreTrainedTokenizerFast", "TokenizersBackend"):
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    raise RuntimeError("transformers has neither PreTrainedTokenizerFast nor TokenizersBackend")


def wrap(tok, **special):
    cls = fast_tokenizer_class()
    return cls(tokenizer_object=tok, **special)


# ---- tokenizers ------------------------------------------------------------------------------


def tok_bytelevel(pattern, specials, bos_template=None, nfc=False, vocab=700):
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(training_corpus(), trainer)
    if bos_template:
        bos_id = tok.token_to_id(bos_template)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_template} $A", pair=f"{bos_template} $A {bos_template} $B:1",
            special_tokens=[(bos_template, bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tok_metaspace(pre_tokenizer_style, vocab=600):
    """Llama-2 style BPE: sentencepiece-like '▁' words, byte fallback, <s> prepended."""
    specials = ["<unk>", "<s>", "</s>"]
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    # Leave rare characters out of the alphabet so byte fallback is exercised.
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, limit_alphabet=60,
                                  show_progress=False)
    base.train_from_iterator(training_corpus(), trainer)
    learned = json.loads(base.to_str())["model"]
    # Rebuild the vocabulary as Llama's is laid out: specials, the 256 byte tokens, the rest.
    vocab_out = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab_out[f"<0x{b:02X}>"] = len(vocab_out)
    for token, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        if token not in vocab_out:
            vocab_out[token] = len(vocab_out)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab_out, merges=merges, unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    if pre_tokenizer_style == "normalizer":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(content=" ", left=1, right=0)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", 1)])
    return tok


def tok_wordpiece(vocab=500):
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                strip_accents=None, lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(training_corpus(), trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok


def tok_wordlevel():
    specials = ["[UNK]", "[PAD]"]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=300, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(training_corpus(), trainer)
    return tok


def tok_gpt2(vocab=700):
    """OPT's tokenizer: GPT-2 byte-level BPE (the regex inside the ByteLevel pre-tokenizer),
    OPT's specials at ids 0-3 and </s> prepended as the beginning of a sequence."""
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(training_corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="</s> $A", pair="</s> $A </s> $B:1", special_tokens=[("</s>", tok.token_to_id("</s>"))])
    return tok


def train_unigram_spm(d, name, byte_fallback, rule, vocab=500):
    """A SentencePiece Unigram model laid out as T5's (pad 0, </s> 1, <unk> 2, no <s>)."""
    import sentencepiece as spm
    corpus = os.path.join(d, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write("\n".join(training_corpus()))
    spm.SentencePieceTrainer.train(
        input=corpus, model_prefix=os.path.join(d, name), vocab_size=vocab, model_type="unigram",
        byte_fallback=byte_fallback, character_coverage=0.995 if byte_fallback else 1.0,
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, add_dummy_prefix=True,
        remove_extra_whitespaces=True, normalization_rule_name=rule, minloglevel=2)
    os.remove(corpus)
    os.remove(os.path.join(d, name + ".vocab"))
    return os.path.join(d, name + ".model")


def tok_unigram_from_spm(model_path):
    """tokenizer.json of a SentencePiece Unigram model the way transformers converts T5's:
    the model's precompiled normalizer (when it has one) and runs of spaces folded, Metaspace
    with a prefix, </s> appended."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    m = pb.ModelProto()
    with open(model_path, "rb") as f:
        m.ParseFromString(f.read())
    vocab = [(p.piece, p.score) for p in m.pieces]
    byte_fallback = m.trainer_spec.byte_fallback
    tok = Tokenizer(models.Unigram(vocab, unk_id=m.trainer_spec.unk_id, byte_fallback=byte_fallback))
    norms = []
    if m.normalizer_spec.precompiled_charsmap:
        norms.append(normalizers.Precompiled(m.normalizer_spec.precompiled_charsmap))
    norms.append(normalizers.Replace(Regex(" {2,}"), " "))
    tok.normalizer = normalizers.Sequence(norms)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    if byte_fallback:
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(content=" ", left=1, right=0)])
    else:
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B:1 </s>:1", special_tokens=[("</s>", 1)])
    return tok


def make_hf_tokenizer(kind):
    """Returns (transformers tokenizer, extra files dict) for one variant name."""
    if kind == "bpe_bytelevel_qwen2":
        tok = tok_bytelevel(QWEN2_PATTERN, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"],
                            nfc=True)
        return wrap(tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    if kind == "bpe_bytelevel_llama3":
        tok = tok_bytelevel(LLAMA3_PATTERN, ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<image>"],
                            bos_template="<|begin_of_text|>")
        return wrap(tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
    if kind == "bpe_metaspace_llama2":
        tok = tok_metaspace("normalizer")
        return wrap(tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if kind == "bpe_metaspace_pretok":
        tok = tok_metaspace("pre_tokenizer")
        return wrap(tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if kind == "wordpiece_bert":
        tok = tok_wordpiece()
        return wrap(tok, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]", cls_token="[CLS]",
                    mask_token="[MASK]")
    if kind == "wordlevel":
        tok = tok_wordlevel()
        return wrap(tok, unk_token="[UNK]", pad_token="[PAD]")
    if kind == "bpe_bytelevel_gpt2":
        tok = tok_gpt2()
        return wrap(tok, bos_token="</s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
    raise ValueError(kind)


UNIGRAM_KINDS = {
    # T5's: NFKC-style precompiled normalizer, no byte fallback (unknown characters are <unk>).
    "unigram_t5": dict(byte_fallback=False, rule="nmt_nfkc"),
    # Byte fallback and no normalizer: rare characters become <0xNN> pieces.
    "unigram_bytefallback": dict(byte_fallback=True, rule="identity"),
}


def make_unigram_tokenizer(d, kind):
    """Trains a Unigram model into folder d (spiece.model) and returns the transformers
    tokenizer of its tokenizer.json."""
    os.makedirs(d, exist_ok=True)
    path = train_unigram_spm(d, "spiece", **UNIGRAM_KINDS[kind])
    return wrap(tok_unigram_from_spm(path), eos_token="</s>", unk_token="<unk>", pad_token="<pad>")


def tokenizer_expected(hf_tok, cases=TOKENIZER_CASES):
    out = []
    for text in cases:
        ids = hf_tok(text)["input_ids"]
        ids_ns = hf_tok(text, add_special_tokens=False)["input_ids"]
        out.append({
            "text": text,
            "ids": ids,
            "ids_no_special": ids_ns,
            "decoded": hf_tok.decode(ids, skip_special_tokens=False),
            "decoded_skip_special": hf_tok.decode(ids, skip_special_tokens=True),
        })
    return {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "cases": out}


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1)
        f.write("\n")


def build_tokenizers(out):
    root = os.path.join(out, "tokenizers")
    for kind in ["bpe_bytelevel_qwen2", "bpe_bytelevel_llama3", "bpe_metaspace_llama2",
                 "bpe_metaspace_pretok", "wordpiece_bert", "wordlevel"]:
        d = os.path.join(root, kind)
        os.makedirs(d, exist_ok=True)
        hf_tok = make_hf_tokenizer(kind)
        hf_tok.save_pretrained(d)
        # Reload from the folder: the expectations are what a user loading it gets.
        reloaded = transformers.AutoTokenizer.from_pretrained(d)
        write_json(os.path.join(d, "expected.json"), tokenizer_expected(reloaded))
        print(f"tokenizer {kind}: vocab {len(reloaded)}")
    build_sentencepiece(os.path.join(root, "sentencepiece_llama"))
    for kind in ["bpe_bytelevel_gpt2"]:
        d = os.path.join(root, kind)
        os.makedirs(d, exist_ok=True)
        make_hf_tokenizer(kind).save_pretrained(d)
        reloaded = transformers.AutoTokenizer.from_pretrained(d)
        write_json(os.path.join(d, "expected.json"), tokenizer_expected(reloaded))
        print(f"tokenizer {kind}: vocab {len(reloaded)}")
    for kind in UNIGRAM_KINDS:
        build_unigram(os.path.join(root, kind), kind)


def build_unigram(d, kind):
    """tokenizer.json, spiece.model and the ids of both: transformers' (from tokenizer.json)
    and SentencePiece's own (no </s>)."""
    import sentencepiece as spm
    make_unigram_tokenizer(d, kind).save_pretrained(d)
    reloaded = transformers.AutoTokenizer.from_pretrained(d)
    expected = tokenizer_expected(reloaded)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(d, "spiece.model"))
    for c in expected["cases"]:
        c["sp_ids"] = sp.encode(c["text"])
        c["sp_decoded"] = sp.decode(c["sp_ids"])
    expected["sentencepiece"] = spm.__version__
    write_json(os.path.join(d, "expected.json"), expected)
    print(f"tokenizer {kind}: vocab {len(reloaded)}")


def build_sentencepiece(d):
    import sentencepiece as spm
    os.makedirs(d, exist_ok=True)
    corpus = os.path.join(d, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write("\n".join(training_corpus()))
    spm.SentencePieceTrainer.train(
        input=corpus, model_prefix=os.path.join(d, "tokenizer"), vocab_size=500, model_type="bpe",
        byte_fallback=True, split_digits=True, character_coverage=0.995, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, add_dummy_prefix=True, remove_extra_whitespaces=False, normalization_rule_name="identity",
        allow_whitespace_only_pieces=True, minloglevel=2)
    os.remove(corpus)
    os.remove(os.path.join(d, "tokenizer.vocab"))
    sp = spm.SentencePieceProcessor(model_file=os.path.join(d, "tokenizer.model"))
    write_json(os.path.join(d, "tokenizer_config.json"), {
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": False})
    cases = []
    for text in TOKENIZER_CASES:
        sp_ids = sp.encode(text)
        cases.append({"text": text, "sp_ids": sp_ids, "sp_decoded": sp.decode(sp_ids)})
    expected = {"sentencepiece": spm.__version__, "transformers": transformers.__version__, "cases": cases}
    try:
        hf = transformers.AutoTokenizer.from_pretrained(d)
        t = tokenizer_expected(hf)
        for c, e in zip(cases, t["cases"]):
            c.update({k: e[k] for k in ("ids", "ids_no_special", "decoded", "decoded_skip_special")})
        expected["transformers_class"] = type(hf).__name__
    except Exception as e:  # recorded, not fatal: sentencepiece's own ids are the reference
        expected["transformers_error"] = repr(e)
    write_json(os.path.join(d, "expected.json"), expected)
    print("tokenizer sentencepiece_llama:", expected.get("transformers_class", expected.get("transformers_error")))


# ---- images and processors --------------------------------------------------------------------


def build_images(out):
    d = os.path.join(out, "images")
    os.makedirs(d, exist_ok=True)
    rng = np.random.RandomState(7)
    # Smooth gradient with a few shapes (the common case).
    h, w = 61, 97
    yy, xx = np.mgrid[0:h, 0:w]
    img = np.stack([xx * 255 / (w - 1), yy * 255 / (h - 1), (xx + yy) * 127 / (w + h)], -1)
    img[10:30, 20:45] = [250, 30, 40]
    img[35:55, 60:90] = [20, 200, 60]
    Image.fromarray(img.astype(np.uint8), "RGB").save(os.path.join(d, "gradient_97x61.png"))
    # High frequencies: resampling kernels show here.
    checker = ((yy[:40, :40] // 3 + xx[:40, :40] // 3) % 2 * 255).astype(np.uint8)
    Image.fromarray(np.stack([checker, 255 - checker, checker // 2], -1), "RGB").save(
        os.path.join(d, "checker_40x40.png"))
    Image.fromarray(rng.randint(0, 256, (77, 123, 3)).astype(np.uint8), "RGB").save(
        os.path.join(d, "noise_123x77.png"))
    Image.fromarray(rng.randint(0, 256, (83, 50)).astype(np.uint8), "L").save(os.path.join(d, "gray_50x83.png"))
    rgba = rng.randint(0, 256, (48, 64, 4)).astype(np.uint8)
    Image.fromarray(rgba, "RGBA").save(os.path.join(d, "rgba_64x48.png"))
    # Smaller than every target size: upscaling.
    Image.fromarray(rng.randint(0, 256, (15, 20, 3)).astype(np.uint8), "RGB").save(
        os.path.join(d, "small_20x15.png"))
    return sorted(os.listdir(d))


def processor_pair(cls_name, **kwargs):
    """transformers 5 processors run on torchvision by default (what AutoProcessor and the
    model processors use); the *Pil classes keep the PIL backend. Returns (default, pil)."""
    default = getattr(transformers, cls_name)(**kwargs)
    pil_cls = getattr(transformers, cls_name + "Pil", None)
    pil = pil_cls(**kwargs) if pil_cls is not None else None
    return default, pil


PROCESSOR_VARIANTS = {
    "clip": ("CLIPImageProcessor", dict(size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30},
                                        resample=3, do_center_crop=True, image_mean=OPENAI_CLIP_MEAN,
                                        image_std=OPENAI_CLIP_STD)),
    "clip_bilinear_oddcrop": ("CLIPImageProcessor", dict(size={"shortest_edge": 45},
                                                         crop_size={"height": 37, "width": 41}, resample=2,
                                                         do_center_crop=True)),
    "siglip": ("SiglipImageProcessor", dict(size={"height": 32, "width": 32}, resample=3,
                                            image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])),
    "blip": ("BlipImageProcessor", dict(size={"height": 24, "width": 24}, resample=3,
                                        image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD)),
    # A crop larger than the resized image: center_crop pads (the backends put the odd
    # padding pixel on different sides).
    "clip_pad": ("CLIPImageProcessor", dict(size={"shortest_edge": 20}, crop_size={"height": 25, "width": 27},
                                            resample=3, do_center_crop=True)),
    "siglip_lanczos": ("SiglipImageProcessor", dict(size={"height": 28, "width": 28}, resample=1)),
    "blip_nearest": ("BlipImageProcessor", dict(size={"height": 26, "width": 26}, resample=0)),
}


def pixel_values(proc, image):
    return proc(images=image, return_tensors="pt")["pixel_values"][0].float().contiguous()


def build_processors(out, images, names=None):
    root = os.path.join(out, "processors")
    for name, (cls_name, kwargs) in PROCESSOR_VARIANTS.items():
        if names is not None and name not in names:
            continue
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        slow, fast = processor_pair(cls_name, **kwargs)
        slow.save_pretrained(d)  # preprocessor_config.json, transformers-4 style
        exp, exp_fast = {}, {}
        for img_name in images:
            img = Image.open(os.path.join(out, "images", img_name))
            stem = os.path.splitext(img_name)[0]
            exp[stem] = pixel_values(slow, img)
            if fast is not None:
                exp_fast[stem] = pixel_values(fast, img)
        safetensors.torch.save_file(exp, os.path.join(d, "expected.safetensors"))
        if exp_fast:
            safetensors.torch.save_file(exp_fast, os.path.join(d, "expected_pil.safetensors"))
            diff = max(float((exp[k] - exp_fast[k]).abs().max()) for k in exp)
        else:
            diff = None
        print(f"processor {name}: torchvision vs PIL backend max |diff| {diff}")
    # The transformers-5 layout: processor_config.json with an "image_processor" entry.
    src = os.path.join(root, "clip")
    d = os.path.join(root, "clip_processor_config")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(src, "preprocessor_config.json")) as f:
        ip = json.load(f)
    write_json(os.path.join(d, "processor_config.json"),
               {"image_processor": ip, "processor_class": "LlavaProcessor", "patch_size": 6,
                "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1})
    shutil.copy(os.path.join(src, "expected.safetensors"), d)
    if os.path.exists(os.path.join(src, "expected_pil.safetensors")):
        shutil.copy(os.path.join(src, "expected_pil.safetensors"), d)


# ---- models -----------------------------------------------------------------------------------


def randomize(model, seed):
    """Weights large enough that logits spread (greedy ties would make parity flaky)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
            elif "norm" in name.lower() and name.endswith("weight"):
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def llama_text_config(vocab, **over):
    cfg = dict(vocab_size=vocab, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
               rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    cfg.update(over)
    return transformers.LlamaConfig(**cfg)


def add_image_token(hf_tok):
    if "<image>" not in hf_tok.get_vocab():
        hf_tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    return hf_tok.convert_tokens_to_ids("<image>")


def greedy_case(model, processor, image, prompt, max_new_tokens, tok):
    inputs = processor(images=image, text=prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                             output_logits=True, return_dict_in_generate=True)
    prompt_len = inputs["input_ids"].shape[1]
    seq = out.sequences[0]
    logits = [l[0].float() for l in out.logits]
    if model.config.get_text_config().is_encoder_decoder:
        # Encoder-decoder generate returns the decoder's start token, then the new tokens.
        new = seq[1:].tolist()
        if new != [int(l.argmax()) for l in logits]:
            raise RuntimeError(f"greedy tokens {new} are not the argmax of the step logits")
    else:
        # Decoder-only generate returns prompt + new tokens.
        new = seq[prompt_len:].tolist() if seq.shape[0] > prompt_len else seq.tolist()
    margins = []
    for l in logits:
        top = torch.topk(l, 2).values
        margins.append(float(top[0] - top[1]))
    case = {
        "prompt": prompt,
        "input_ids": inputs["input_ids"][0].tolist(),
        "first_logits": [round(float(v), 6) for v in logits[0].tolist()],
        "greedy_tokens": new,
        "max_new_tokens": max_new_tokens,
        "text": tok.decode(new, skip_special_tokens=True),
        "min_top2_margin": min(margins),
    }
    if "qformer_input_ids" in inputs:
        case["qformer_input_ids"] = inputs["qformer_input_ids"][0].tolist()
    return case, inputs["pixel_values"][0].float().contiguous()


MODEL_CASES = [
    ("gradient_97x61.png", "USER: <image>\nWhat is shown? ASSISTANT:"),
    ("noise_123x77.png", "USER: <image>\nWhat color is the shirt? ASSISTANT:"),
]


def reset_rope_state(model):
    """Dynamic RoPE keeps the longest sequence it has seen (max_seq_len_cached) and its
    frequencies across calls; every case starts from the freshly loaded state, so that each
    reference depends on its own input only."""
    for m in model.modules():
        if hasattr(m, "original_inv_freq") and hasattr(m, "max_seq_len_cached"):
            m.inv_freq = m.original_inv_freq.clone()
            m.max_seq_len_cached = m.original_max_seq_len


def finish_model(d, model, processor, tok, out, cases, max_new_tokens=8, note=""):
    exp_cases, pixels = [], {}
    for i, (img_name, prompt) in enumerate(cases):
        reset_rope_state(model)
        image = Image.open(os.path.join(out, "images", img_name))
        case, pv = greedy_case(model, processor, image, prompt, max_new_tokens, tok)
        case["image"] = img_name
        exp_cases.append(case)
        pixels[f"case{i}"] = pv
    safetensors.torch.save_file(pixels, os.path.join(d, "expected_pixels.safetensors"))
    write_json(os.path.join(d, "expected.json"), {
        "transformers": transformers.__version__, "torch": torch.__version__, "note": note,
        "attn_implementation": "eager", "dtype": "float32", "cases": exp_cases})
    print(f"model {os.path.basename(d)}: " + "; ".join(
        f"{len(c['input_ids'])} ids, tokens {c['greedy_tokens']}, margin {c['min_top2_margin']:.4f}"
        for c in exp_cases))


def save_model(model, d, dtype=None, shard=None):
    m = model if dtype is None else copy.deepcopy(model).to(dtype)
    kwargs = {}
    if shard:
        kwargs["max_shard_size"] = shard
    m.save_pretrained(d, **kwargs)


def reload_eager(cls, d):
    """Loads the saved folder back; a tensor transformers did not find or did not use would
    mean the reference came from random weights, so it is an error."""
    m, info = cls.from_pretrained(d, attn_implementation="eager", dtype=torch.float32,
                                  output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"{d}: transformers did not load every tensor: {bad}")
    return m.eval()


def force_early_eos(model, processor, out, tok, step=2):
    """Makes greedy decoding of the first model case end with EOS after `step` tokens: the
    EOS row of the (untied) LM head becomes 1.5x the row of the token chosen at `step`, so EOS
    outscores it there (or earlier). The reference is then computed from the saved weights."""
    img_name, prompt = MODEL_CASES[0]
    image = Image.open(os.path.join(out, "images", img_name))
    case, _ = greedy_case(model, processor, image, prompt, 8, tok)
    target = case["greedy_tokens"][step]
    head = model.get_output_embeddings().weight
    if model.config.get_text_config().tie_word_embeddings:
        raise RuntimeError("force_early_eos needs an untied LM head")
    with torch.no_grad():
        head[tok.eos_token_id].copy_(head[target] * 1.5)


def build_llava(out, name, vision, text_kind, text_over, layer, strategy, save_dtype=None, shard=None,
                legacy=False, eos_case=False):
    d = os.path.join(out, "models", name)
    os.makedirs(d, exist_ok=True)
    seed_all(sum(map(ord, name)))
    tok = make_hf_tokenizer(text_kind)
    image_id = add_image_token(tok)
    if vision == "clip":
        vcfg = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                             num_attention_heads=4, image_size=30, patch_size=6,
                                             projection_dim=32, hidden_act="quick_gelu")
        ip = transformers.CLIPImageProcessor(size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30},
                                             resample=3, image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD)
        extra = 1
    else:
        vcfg = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                               num_attention_heads=4, image_size=32, patch_size=8)
        ip = transformers.SiglipImageProcessor(size={"height": 32, "width": 32}, resample=3)
        extra = 0
    if text_kind.startswith("bpe_bytelevel_qwen2"):
        tcfg = transformers.Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=112,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=256, rms_norm_eps=1e-6,
                                        tie_word_embeddings=True, **text_over)
        tcfg.eos_token_id = tok.eos_token_id
    else:
        tcfg = llama_text_config(len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                 **text_over)
    cfg = transformers.LlavaConfig(vision_config=vcfg, text_config=tcfg, image_token_index=image_id,
                                   vision_feature_layer=layer, vision_feature_select_strategy=strategy,
                                   projector_hidden_act="gelu")
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    randomize(model, 11)
    processor = transformers.LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=vcfg.patch_size,
                                            vision_feature_select_strategy=strategy,
                                            num_additional_image_tokens=extra, image_token="<image>")
    if eos_case:
        force_early_eos(model, processor, out, tok)
    save_model(model, d, save_dtype, shard)
    processor.save_pretrained(d)
    if legacy:
        to_legacy_layout(d)
    ref = reload_eager(transformers.LlavaForConditionalGeneration, d)
    proc = transformers.AutoProcessor.from_pretrained(d)
    finish_model(d, ref, proc, proc.tokenizer, out, MODEL_CASES,
                 note=f"llava {vision} layer {layer} {strategy}, weights saved as {save_dtype or 'float32'}, "
                      f"reference computed in float32 from the saved weights" + (", transformers-4 layout" if legacy else ""))


LEGACY_LLAVA_PREFIXES = [  # name as transformers 5 saves or holds it -> transformers-4 name
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("vision_tower.vision_model.", "vision_tower.vision_model."),
    ("vision_tower.", "vision_tower.vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
]


def to_legacy_layout(d):
    """Rewrites a saved LLaVA folder as transformers 4.x wrote it: old tensor names, shards
    of our own, rope_theta/rope_scaling at the top of text_config, torch_dtype."""
    index_path = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    tensors = {}
    for s in shards:
        tensors.update(safetensors.torch.load_file(os.path.join(d, s)))
        os.remove(os.path.join(d, s))
    if os.path.exists(index_path):
        os.remove(index_path)
    renamed = {}
    for k, v in tensors.items():
        for new, old in LEGACY_LLAVA_PREFIXES:
            if k.startswith(new):
                k = old + k[len(new):]
                break
        renamed[k] = v
    names = sorted(renamed)
    parts = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map, total = {}, 0
    for i, part in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        safetensors.torch.save_file({k: renamed[k].contiguous() for k in part}, os.path.join(d, fname),
                                    metadata={"format": "pt"})
        for k in part:
            weight_map[k] = fname
            total += renamed[k].numel() * renamed[k].element_size()
    write_json(index_path, {"metadata": {"total_size": total}, "weight_map": weight_map})
    cfg_path = os.path.join(d, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)

    def legacy(sub):
        rp = sub.pop("rope_parameters", None)
        if rp:
            rp = dict(rp)
            sub["rope_theta"] = rp.pop("rope_theta", 10000.0)
            if rp.get("rope_type", "default") != "default":
                sub["rope_scaling"] = rp
            else:
                sub["rope_scaling"] = None
        if "dtype" in sub:
            sub["torch_dtype"] = sub.pop("dtype")
    legacy(cfg)
    for key in ("text_config", "vision_config"):
        if key in cfg:
            legacy(cfg[key])
    cfg["transformers_version"] = "4.45.2"
    write_json(cfg_path, cfg)


def opt_text_config(vocab, tok, **over):
    """blip2-opt-2.7b's language model, shrunk: pre-LayerNorm blocks, ReLU MLP, learned
    positions (offset 2), tied head."""
    cfg = dict(vocab_size=vocab, hidden_size=64, ffn_dim=112, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=128, word_embed_proj_dim=64, do_layer_norm_before=True,
               activation_function="relu", enable_bias=True, layer_norm_elementwise_affine=True,
               bos_token_id=tok.convert_tokens_to_ids("</s>"), eos_token_id=tok.convert_tokens_to_ids("</s>"),
               pad_token_id=tok.convert_tokens_to_ids("<pad>"), tie_word_embeddings=True, dropout=0.1)
    cfg.update(over)
    return transformers.OPTConfig(**cfg)


def t5_text_config(vocab, **over):
    """blip2-flan-t5-xl's language model, shrunk: relative position buckets, RMS norm without
    bias, gated-GELU MLP, untied head."""
    cfg = dict(vocab_size=vocab, d_model=64, d_kv=16, d_ff=112, num_layers=2, num_decoder_layers=2,
               num_heads=4, relative_attention_num_buckets=32, relative_attention_max_distance=128,
               feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
               pad_token_id=0, eos_token_id=1, layer_norm_epsilon=1e-6, dropout_rate=0.1)
    cfg.update(over)
    return transformers.T5Config(**cfg)


# The language models a BLIP-2 / InstructBLIP fixture can have: (tokenizer kind, config maker).
BLIP2_TEXT = {
    "llama": "bpe_metaspace_llama2",
    "opt": "bpe_bytelevel_gpt2",
    "opt_proj": "bpe_bytelevel_gpt2",
    "t5": "unigram_t5",
}


def build_blip2(out, name, instruct, text="llama"):
    d = os.path.join(out, "models", name)
    os.makedirs(d, exist_ok=True)
    seed_all((5 if instruct else 3) + (0 if text == "llama" else sum(map(ord, name))))
    if text == "t5":
        tok = make_unigram_tokenizer(d, BLIP2_TEXT[text])  # leaves spiece.model in the folder
    else:
        tok = make_hf_tokenizer(BLIP2_TEXT[text])
    image_id = add_image_token(tok)
    prefix = "InstructBlip" if instruct else "Blip2"
    vcfg = getattr(transformers, prefix + "VisionConfig")(hidden_size=32, intermediate_size=64,
                                                           num_hidden_layers=2, num_attention_heads=4,
                                                           image_size=24, patch_size=6)
    qkw = dict(vocab_size=600, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
               intermediate_size=64, cross_attention_frequency=2, encoder_hidden_size=32,
               max_position_embeddings=64)
    qcfg = getattr(transformers, prefix + "QFormerConfig")(**qkw)
    if text == "llama":
        tcfg = llama_text_config(len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    elif text == "opt":
        tcfg = opt_text_config(len(tok), tok)
    elif text == "opt_proj":
        # opt-350m's layout: embeddings narrower than the blocks (project_in / project_out) and
        # post-LayerNorm blocks without a final norm.
        tcfg = opt_text_config(len(tok), tok, word_embed_proj_dim=48, do_layer_norm_before=False)
    else:
        tcfg = t5_text_config(len(tok))
    cfg = getattr(transformers, prefix + "Config")(vision_config=vcfg.to_dict(), qformer_config=qcfg.to_dict(),
                                                   text_config=tcfg.to_dict(), num_query_tokens=8,
                                                   image_token_index=image_id)
    if instruct:
        qtok = make_hf_tokenizer("wordpiece_bert")
        cfg.qformer_config.vocab_size = max(len(qtok), 600)
    model = getattr(transformers, prefix + "ForConditionalGeneration")(cfg).eval()
    randomize(model, 13)
    ip = transformers.BlipImageProcessor(size={"height": 24, "width": 24}, resample=3,
                                         image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD)
    if instruct:
        processor = transformers.InstructBlipProcessor(image_processor=ip, tokenizer=tok, qformer_tokenizer=qtok,
                                                       num_query_tokens=8)
    else:
        processor = transformers.Blip2Processor(image_processor=ip, tokenizer=tok, num_query_tokens=8)
    save_model(model, d, torch.float16)
    processor.save_pretrained(d)
    ref = reload_eager(getattr(transformers, prefix + "ForConditionalGeneration"), d)
    proc = transformers.AutoProcessor.from_pretrained(d)
    cases = [("gradient_97x61.png", "Question: what color is the shirt? Answer:"),
             ("checker_40x40.png", "Describe the picture.")]
    finish_model(d, ref, proc, proc.tokenizer, out, cases,
                 note=f"{prefix} with a {text} language model, weights saved as float16, reference computed "
                      "in float32 from them")


def check_llava_processor(d, expected, pixels):
    """True if the folder's LlavaProcessor makes of each case's question and image (8-bit, as
    recorded) the prompt, LM input ids and pixel values cdcca recorded."""
    processor = transformers.AutoProcessor.from_pretrained(d)
    ok = True
    for i, case in enumerate(expected["cases"]):
        question = case["prompt"].split("<bos> ", 1)[1]
        conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        prompt = processor.apply_chat_template(conversation, add_generation_prompt=True)
        # The recorded pixel values are (x / 255 - 0.5) / 0.25 of an 8-bit image.
        rgb = ((pixels[f"case{i}"] * 0.25 + 0.5) * 255).round().clamp(0, 255).to(torch.uint8)
        image = Image.fromarray(rgb.permute(1, 2, 0).numpy())
        inputs = processor(images=image, text=prompt, return_tensors="pt")
        same_prompt = prompt == case["prompt"]
        same_ids = inputs["input_ids"][0].tolist() == case["input_ids"]
        px_diff = float((inputs["pixel_values"][0] - pixels[f"case{i}"]).abs().max())
        good = same_prompt and same_ids and px_diff <= 1e-5
        print(f"{d} case {i}: processor prompt {prompt!r} ({'same' if same_prompt else 'DIFFERENT'}), "
              f"ids {'same' if same_ids else 'DIFFERENT'}, pixel values max diff {px_diff:.1e}: "
              f"{'OK' if good else 'DIFFERENT'}")
        ok = ok and good
    return ok


def check_family(d):
    """True if transformers answers as cdcca recorded in folder d (see the module doc)."""
    with open(os.path.join(d, "cdcca_expected.json")) as f:
        expected = json.load(f)
    pixels = safetensors.torch.load_file(os.path.join(d, "cdcca_pixels.safetensors"))
    with open(os.path.join(d, "config.json")) as f:
        model_type = json.load(f)["model_type"]
    cls = {"blip-2": transformers.Blip2ForConditionalGeneration,
           "llava": transformers.LlavaForConditionalGeneration}[model_type]
    model = reload_eager(cls, d)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    ok = True
    if model_type == "llava":
        ok = check_llava_processor(d, expected, pixels)
    for i, case in enumerate(expected["cases"]):
        ids = torch.tensor([case["input_ids"]])
        with torch.no_grad():
            out = model.generate(pixel_values=pixels[f"case{i}"].unsqueeze(0), input_ids=ids,
                                 attention_mask=torch.ones_like(ids),
                                 max_new_tokens=case["max_new_tokens"], do_sample=False, num_beams=1,
                                 output_logits=True, return_dict_in_generate=True)
        tokens = [int(l[0].argmax()) for l in out.logits]
        first = out.logits[0][0].float()
        ref = torch.tensor(case["first_logits"])
        rel = float((first - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        same = tokens == case["greedy_tokens"] and rel <= 1e-4
        if "prompt" in case:
            enc = tok(case["prompt"], add_special_tokens=False)["input_ids"]
            if enc != case["prompt_ids"]:
                print(f"{d} case {i}: tokenizer gives {enc}, cdcca used {case['prompt_ids']}")
                same = False
        print(f"{d} case {i}: transformers {tokens}, cdcca {case['greedy_tokens']}, "
              f"first logits max rel diff {rel:.2e}: {'OK' if same else 'DIFFERENT'}")
        ok = ok and same
    return ok


def write_readme(out):
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(
            "# Hugging Face reference fixtures\n\n"
            "Made by `python3 scripts/hf_fixtures.py --out tests/fixtures/hf` with transformers "
            f"{transformers.__version__}, tokenizers {tokenizers.__version__}, torch {torch.__version__} "
            "(random weights, tiny shapes, nothing downloaded). Do not edit by hand: rerun the script.\n\n"
            "- `images/`: test images (non-square, grayscale, RGBA, smaller than every target).\n"
            "- `processors/<variant>/`: image-processor settings; `expected.safetensors` holds the default "
            "(torchvision backend) processor's pixel_values [3,H,W] per image stem, `expected_pil.safetensors` "
            "the PIL backend's (`*ImageProcessorPil`).\n"
            "- `tokenizers/<variant>/`: tokenizer files and `expected.json` (ids with and without special "
            "tokens, decoded text with and without specials) on a corpus with Unicode, digits, whitespace "
            "runs and newlines.\n"
            "- `models/<variant>/`: model folders; `expected.json` per case: prompt, LM input ids, "
            "full-vocabulary first-step logits (float32, eager attention), greedy tokens, decoded text, "
            "and the smallest top-2 logit margin over the greedy steps; `expected_pixels.safetensors` the "
            "pixel values the model received.\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="fixture directory to write (tests/fixtures/hf)")
    ap.add_argument("--check_family", nargs="+", metavar="DIR",
                    help="instead: check cdcca family folders against transformers")
    ap.add_argument("--only", default="", help="comma list of parts: tokenizers,processors,models")
    ap.add_argument("--names", default="",
                    help="comma list: build only these model fixtures and processor variants")
    args = ap.parse_args()
    if args.check_family:
        print("transformers", transformers.__version__, "torch", torch.__version__)
        results = [check_family(d) for d in args.check_family]
        sys.exit(0 if all(results) else 1)
    if not args.out:
        ap.error("--out or --check_family is required")
    names = set(args.names.split(",")) if args.names else None
    parts = set(args.only.split(",")) if args.only else {"tokenizers", "processors", "models"}
    torch.set_num_threads(4)
    os.makedirs(args.out, exist_ok=True)
    print("transformers", transformers.__version__, "tokenizers", tokenizers.__version__, "torch",
          torch.__version__)
    images = build_images(args.out)
    failures = []

    def attempt(label, fn, *a, **k):
        if names is not None and fn in (build_llava, build_blip2) and label not in names:
            return
        try:
            fn(*a, **k)
        except Exception as e:  # keep going: one broken variant must not hide the others
            import traceback
            traceback.print_exc()
            failures.append(f"{label}: {e!r}")

    if "tokenizers" in parts:
        attempt("tokenizers", build_tokenizers, args.out)
    if "processors" in parts:
        attempt("processors", build_processors, args.out, images, names)
    if "models" in parts:
        attempt("llava_clip_llama", build_llava, args.out, "llava_clip_llama", "clip", "bpe_metaspace_llama2",
                dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), -2, "default")
        attempt("llava_siglip_qwen2", build_llava, args.out, "llava_siglip_qwen2", "siglip", "bpe_bytelevel_qwen2",
                {}, -1, "full")
        attempt("llava_clip_llama_gqa_rope", build_llava, args.out, "llava_clip_llama_gqa_rope", "clip",
                "bpe_bytelevel_llama3",
                dict(num_key_value_heads=2, attention_bias=True, rope_theta=500000.0,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
                -1, "default", save_dtype=torch.bfloat16, shard="150KB", legacy=True)
        # Attention and MLP biases, yarn RoPE over a sequence (25 image tokens + prompt) longer
        # than its original context, and a first case whose greedy answer ends with EOS.
        attempt("llava_clip_llama_bias_yarn", build_llava, args.out, "llava_clip_llama_bias_yarn", "clip",
                "bpe_metaspace_llama2",
                dict(attention_bias=True, mlp_bias=True, max_position_embeddings=64,
                     rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
                -2, "default", eos_case=True)
        # Dynamic NTK RoPE: the prompt already exceeds max_position_embeddings, and every
        # generated token grows the base again.
        attempt("llava_clip_llama_dynamic", build_llava, args.out, "llava_clip_llama_dynamic", "clip",
                "bpe_bytelevel_llama3",
                dict(max_position_embeddings=24, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
                -1, "full")
        attempt("blip2_llama", build_blip2, args.out, "blip2_llama", False)
        attempt("instructblip_llama", build_blip2, args.out, "instructblip_llama", True)
        attempt("blip2_opt", build_blip2, args.out, "blip2_opt", False, "opt")
        attempt("blip2_opt_proj", build_blip2, args.out, "blip2_opt_proj", False, "opt_proj")
        attempt("blip2_flan_t5", build_blip2, args.out, "blip2_flan_t5", False, "t5")
        attempt("instructblip_flan_t5", build_blip2, args.out, "instructblip_flan_t5", True, "t5")
    write_readme(args.out)
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("all fixtures written")


if __name__ == "__main__":
    main()
