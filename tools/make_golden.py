#!/usr/bin/env python3
"""Write the Hugging Face golden fixtures that memtune's C++ tests compare against.

    python3 tools/make_golden.py --out tests/fixtures/golden

Each fixture folder is a tiny Llama (transformers' LlamaForCausalLM, fp32, eager attention)
with a PEFT LoRA adapter, plus the outputs of a forward/backward pass and five AdamW steps. The
family fixtures (qwen2_bias, qwen3_qk_norm, mistral_head_dim) are the same with transformers'
Qwen2ForCausalLM, Qwen3ForCausalLM and MistralForCausalLM at odd sizes.

    python3 tools/make_golden.py --out tests/fixtures/golden --only qwen2_bias,qwen3_qk_norm

writes only the named folders and leaves README.md alone (it describes the Llama fixtures).
tests/fixtures/golden/README.md (written by this script) describes every file.

This script doubles as documentation of the Hugging Face semantics that the engine must
match. The comments marked "SEMANTICS" are the facts that matter; `reference_forward` is a
from-scratch restatement of the Llama + LoRA forward pass in plain torch ops and is checked
against transformers' output, so every statement in it is verified on every run.

Everything is seeded and deterministic (float32, one CPU thread, deterministic algorithms).
Requirements: tools/requirements-golden.txt.
"""

import argparse
import copy
import json
import math
import os
import platform
import shutil
import sys

import numpy as np
import peft
import safetensors
import torch
import torch.nn.functional as F
import transformers
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

# SEMANTICS: label value that the HF loss skips (torch cross_entropy's ignore_index default).
IGNORE_INDEX = -100

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# initializer_range 0.02 (HF's default) makes logits nearly uniform, so the loss hardly depends
# on the weights. 0.15 gives logits with a std of about 1 and a loss that moves when the
# weights do. RMSNorm weights are then redrawn as 1 + NORM_WEIGHT_STD * randn so that a wrong
# norm-weight path shows up in the comparison.
INITIALIZER_RANGE = 0.15
NORM_WEIGHT_STD = 0.1
# PEFT initialises lora_B to zeros, which makes every lora_A gradient zero on the first step.
# The fixtures overwrite lora_B with LORA_B_STD * randn; lora_A keeps PEFT's own init.
LORA_B_STD = 0.05
# transformers zeroes every nn.Linear bias at init; Qwen2's q/k/v biases are redrawn as
# BIAS_STD * randn so that a bias that never reaches the math shows up.
BIAS_STD = 0.5

BASE_CONFIGS = {
    "gqa_rope": dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: 2 query heads share each kv head
        head_dim=16,
        vocab_size=300,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        # original_max_position_embeddings is small on purpose so that the three bands of
        # llama3 scaling (unchanged / smoothed / divided by factor) all occur at head_dim 16.
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "tied_odd": dict(
        hidden_size=72,
        intermediate_size=200,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,  # multi-query: all 3 query heads share one kv head
        head_dim=24,
        vocab_size=263,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,  # no rope_scaling: plain RoPE
        max_position_embeddings=2048,
        tie_word_embeddings=True,  # lm_head.weight IS model.embed_tokens.weight
        bos_token_id=1,
        eos_token_id=2,
    ),
}

# The families beyond Llama (issue 25), at odd sizes: head_dim != hidden / heads, GQA, tied and
# untied. "model_type" picks transformers' config and model classes.
BASE_CONFIGS.update({
    "qwen2_bias": dict(
        model_type="qwen2",  # biases on q, k and v; use_sliding_window false (the window is off)
        hidden_size=40,
        intermediate_size=52,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=10,  # hidden / heads would be 6.67
        vocab_size=97,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=2048,
        use_sliding_window=False,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen3_qk_norm": dict(
        model_type="qwen3",  # RMSNorm per head on q and k before RoPE
        hidden_size=36,
        intermediate_size=50,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=14,  # hidden / heads would be 9
        vocab_size=89,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=2048,
        use_sliding_window=False,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "mistral_head_dim": dict(
        model_type="mistral",  # Llama's layer; explicit head_dim; a window no row reaches
        hidden_size=44,
        intermediate_size=60,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=12,  # hidden / heads would be 11
        vocab_size=83,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        max_position_embeddings=2048,
        sliding_window=32,  # longer than every row here: the mask is causal only
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
})
# Mistral with a window that the rows reach (forward rows of 16, training rows of 12): keys 6 or
# more positions back are masked.
BASE_CONFIGS["mistral_window"] = dict(BASE_CONFIGS["mistral_head_dim"], sliding_window=6)

# (folder, base config, use_rslora, seed). The rslora variant uses the same seed as gqa_rope,
# so its base weights, batch and LoRA weights are bit-identical to gqa_rope's: only the LoRA
# scaling differs (alpha/sqrt(r) = 4 instead of alpha/r = 2).
FIXTURES = [
    ("gqa_rope", "gqa_rope", False, 1234),
    ("gqa_rope_rslora", "gqa_rope", True, 1234),
    ("tied_odd", "tied_odd", False, 5678),
    ("qwen2_bias", "qwen2_bias", False, 2501),
    ("qwen3_qk_norm", "qwen3_qk_norm", False, 2502),
    ("mistral_head_dim", "mistral_head_dim", False, 2503),
    ("mistral_window", "mistral_window", False, 2504),
]

LORA_R = 4
LORA_ALPHA = 8

FORWARD_BATCH = 2
FORWARD_SEQ = 16

TRAIN = dict(
    steps=5,
    grad_accum=2,  # micro-batches per optimizer step
    micro_batch=2,
    seq=12,
    lr=1e-2,
    betas=(0.9, 0.999),
    eps=1e-8,
    weight_decay=0.01,
    max_grad_norm=1.0,
)


def versions():
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }


def st_metadata(extra=None):
    """safetensors __metadata__ (str -> str). The safetensors writer emits the metadata map in
    hash order, so several keys would make the bytes differ from run to run; one key holding a
    sorted JSON string keeps the files byte-reproducible."""
    md = {"generator": "tools/make_golden.py", **versions(), **(extra or {})}
    return {"memtune_golden": json.dumps(md, sort_keys=True)}


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


# --------------------------------------------------------------------------------------------
# Loss semantics
# --------------------------------------------------------------------------------------------

def shifted_targets(labels):
    """SEMANTICS (the shift): position t of the logits predicts token t+1. HF pads labels on the
    right with -100 and drops the first column, so logits[:, t] is scored against labels[:, t+1]
    and the last logit position is never scored. labels[:, 0] is never a target. Equivalent to
    comparing logits[:, :-1] with labels[:, 1:]."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]


def count_items(labels):
    """Number of scored tokens: non-ignored SHIFTED labels (labels[:, 1:] != -100)."""
    return int((shifted_targets(labels) != IGNORE_INDEX).sum())


def token_loss_sum(logits, labels):
    """Sum of the per-token cross entropies (fp32 log-softmax over the vocab), -100 skipped."""
    v = logits.shape[-1]
    return F.cross_entropy(
        logits.float().reshape(-1, v),
        shifted_targets(labels).reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


# --------------------------------------------------------------------------------------------
# Model construction
# --------------------------------------------------------------------------------------------

def model_type_of(cfg_kwargs):
    return cfg_kwargs.get("model_type", "llama")


def build_base(cfg_kwargs, seed):
    """transformers' own seeded init (normal(0, initializer_range) for Linear and Embedding,
    ones for RMSNorm, zeros for biases), then the RMSNorm weights (Qwen3's q_norm / k_norm
    included) redrawn around 1 and the biases (Qwen2's q/k/v) redrawn around 0."""
    kwargs = {k: v for k, v in cfg_kwargs.items() if k != "model_type"}
    if model_type_of(cfg_kwargs) == "llama":
        config = LlamaConfig(**kwargs, initializer_range=INITIALIZER_RANGE, attn_implementation="eager")
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).float()
    else:
        config = AutoConfig.for_model(model_type_of(cfg_kwargs), **kwargs,
                                      initializer_range=INITIALIZER_RANGE, attn_implementation="eager")
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + NORM_WEIGHT_STD * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(BIAS_STD * torch.randn(p.shape, generator=gen))
    model.eval()  # no dropout anywhere in Llama anyway (attention_dropout 0.0)
    return model


def lora_config(use_rslora):
    # SEMANTICS (scaling): the LoRA branch adds scaling * B(A(x)) to the frozen layer's output,
    # scaling = lora_alpha / r (= 2 here), or lora_alpha / sqrt(r) (= 4) when use_rslora.
    return LoraConfig(
        r=LORA_R,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,  # PEFT then uses nn.Identity for the dropout
        target_modules=LORA_TARGETS,
        bias="none",
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
    )


def attach_lora(base, use_rslora, seed):
    """SEMANTICS (init): PEFT's lora_A weight is [r, in_features] and is initialised with
    kaiming_uniform_(a=sqrt(5)), i.e. U(-b, b) with b = gain*sqrt(3/fan_in), gain = sqrt(2/(1+5)),
    so b = 1/sqrt(in_features) (the nn.Linear default). lora_B weight is [out_features, r],
    zeros. We keep lora_A as PEFT drew it and overwrite lora_B with LORA_B_STD * randn."""
    torch.manual_seed(seed + 2)  # PEFT draws lora_A from the global torch RNG
    model = get_peft_model(base, lora_config(use_rslora))
    gen = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".lora_B." in name:
                p.copy_(LORA_B_STD * torch.randn(p.shape, generator=gen))
    model.eval()
    return model


def peft_key(param_name):
    """SEMANTICS (names): in memory a LoRA parameter is named
        base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight
    ('default' is the adapter name). adapter_model.safetensors stores it without the adapter
    name:  base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"""
    return param_name.replace(".default.", ".")


def lora_params(model):
    """(saved key, parameter) for every trainable parameter, in named_parameters order
    (layer by layer, q,k,v,o then gate,up,down; A before B)."""
    out = [(peft_key(n), p) for n, p in model.named_parameters() if p.requires_grad]
    assert out and all(".lora_A." in k or ".lora_B." in k for k, _ in out), [k for k, _ in out]
    return out


# --------------------------------------------------------------------------------------------
# Independent restatement of the forward pass (checked against transformers)
# --------------------------------------------------------------------------------------------

def llama3_inv_freq(head_dim, theta, scaling):
    """RoPE inverse frequencies, fp32, as transformers computes them (default and llama3).
    Returns (inv_freq, band) with band[i] in {"unchanged", "smoothed", "divided"} for llama3."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv, None
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    orig = scaling["original_max_position_embeddings"]
    low_wl, high_wl = orig / low, orig / high
    wavelen = 2 * math.pi / inv  # fp32
    divided = wavelen > low_wl
    unchanged = wavelen < high_wl
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(divided, inv / factor, torch.where(unchanged, inv, smoothed))
    band = ["divided" if d else "unchanged" if u else "smoothed"
            for d, u in zip(divided.tolist(), unchanged.tolist())]
    return out, band


def reference_forward(weights, adapter, cfg, scaling, input_ids):
    """Llama + LoRA forward from the saved files only, fp32. Mirrors transformers 5.x
    modeling_llama.py and peft tuners/lora/layer.py; no attention mask (pure causal)."""
    H, nh, nkv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    B, T = input_ids.shape

    def rmsnorm(x, w):
        # SEMANTICS: x.float() * rsqrt(mean(x^2) + eps), cast back to the input dtype, THEN * w.
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def linear(x, prefix):
        y = x @ weights[prefix + ".weight"].T
        # SEMANTICS (Qwen2 bias): the frozen layer's F.linear adds its bias, and PEFT adds the
        # LoRA term to that output: bias before LoRA. Llama, Qwen3 and Mistral have none.
        if prefix + ".bias" in weights:
            y = y + weights[prefix + ".bias"]
        a = adapter.get("base_model.model." + prefix + ".lora_A.weight")
        if a is not None:
            b = adapter["base_model.model." + prefix + ".lora_B.weight"]
            y = y + (x @ a.T) @ b.T * scaling
        return y

    inv_freq, _ = llama3_inv_freq(hd, cfg["rope_theta"], cfg.get("rope_scaling"))
    # SEMANTICS (rope): positions 0..T-1 (float) times inv_freq in fp32; the angle vector is
    # cat(freqs, freqs) (half-split layout, NOT interleaved pairs); cos/sin in fp32, then cast
    # to the activation dtype (matters in bf16: the cast happens before q*cos).
    freqs = torch.arange(T).float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()

    def rope(x):  # x [B, heads, T, hd]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    causal = torch.full((T, T), float("-inf")).triu(1)
    # SEMANTICS (Mistral's sliding window, masking_utils.sliding_window_overlay): query i keeps
    # key j only when j > i - sliding_window, i.e. i - j < sliding_window.
    if cfg.get("model_type") == "mistral" and cfg.get("sliding_window"):
        causal = causal.masked_fill(torch.ones(T, T, dtype=torch.bool).tril(-cfg["sliding_window"]), float("-inf"))
    h = weights["model.embed_tokens.weight"][input_ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        x = rmsnorm(h, weights[p + ".input_layernorm.weight"])
        q = linear(x, p + ".self_attn.q_proj").view(B, T, nh, hd)
        k = linear(x, p + ".self_attn.k_proj").view(B, T, nkv, hd)
        # SEMANTICS (Qwen3 q/k norm): RMSNorm over each head's head_dim values of the projection
        # output (LoRA included), with its own [head_dim] weight and rms_norm_eps, before RoPE.
        if p + ".self_attn.q_norm.weight" in weights:
            q = rmsnorm(q, weights[p + ".self_attn.q_norm.weight"])
            k = rmsnorm(k, weights[p + ".self_attn.k_norm.weight"])
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = linear(x, p + ".self_attn.v_proj").view(B, T, nkv, hd).transpose(1, 2)
        q, k = rope(q), rope(k)
        # SEMANTICS (GQA): kv head j serves query heads j*g .. j*g+g-1 (g = nh/nkv),
        # i.e. repeat_interleave along the head axis.
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        s = q @ k.transpose(-1, -2) * hd ** -0.5 + causal
        att = torch.softmax(s.float(), dim=-1).to(q.dtype) @ v
        h = h + linear(att.transpose(1, 2).reshape(B, T, nh * hd), p + ".self_attn.o_proj")
        x = rmsnorm(h, weights[p + ".post_attention_layernorm.weight"])
        m = F.silu(linear(x, p + ".mlp.gate_proj")) * linear(x, p + ".mlp.up_proj")
        h = h + linear(m, p + ".mlp.down_proj")
    h = rmsnorm(h, weights["model.norm.weight"])
    # tied embeddings: lm_head.weight is absent from model.safetensors; use embed_tokens.
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    return h @ head.T


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------

def write_legacy_config(folder, base, checks):
    """config_hf4.json: the same config in the layout transformers 4.x wrote and Meta's Hub
    checkpoints use: top-level rope_theta and rope_scaling (or null) instead of v5's nested
    rope_parameters. Checked: transformers 5 reads it back to the same RoPE parameters and the
    same inv_freq."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    write_json(os.path.join(folder, "config_hf4.json"), cfg)
    legacy = type(base.config).from_json_file(os.path.join(folder, "config_hf4.json"))
    assert legacy.rope_parameters == base.config.rope_parameters, (legacy.rope_parameters, base.config.rope_parameters)
    legacy._attn_implementation = "eager"
    legacy_rope = type(base.model.rotary_emb)(legacy)
    assert torch.equal(legacy_rope.inv_freq, base.model.rotary_emb.inv_freq)
    checks["config_hf4_same_inv_freq"] = 0.0


def forward_batch(vocab, gen):
    ids = torch.randint(0, vocab, (FORWARD_BATCH, FORWARD_SEQ), generator=gen)
    labels = ids.clone()
    labels[0, :4] = IGNORE_INDEX   # a "prompt" of 4 tokens in row 0
    labels[1, :7] = IGNORE_INDEX   # a "prompt" of 7 tokens in row 1
    labels[1, -1] = IGNORE_INDEX   # and a trailing "pad" in row 1
    return ids, labels


def train_batches(vocab, gen):
    """[step, micro, batch, seq] ids and labels. Each row masks a prompt prefix of 1..6 tokens
    and 0..2 trailing pad tokens, so the micro-batches of a step carry different numbers of
    scored tokens and the cross-micro-batch normalisation is exercised."""
    t = TRAIN
    shape = (t["steps"], t["grad_accum"], t["micro_batch"], t["seq"])
    ids = torch.randint(0, vocab, shape, generator=gen)
    labels = ids.clone()
    for s in range(t["steps"]):
        for m in range(t["grad_accum"]):
            for b in range(t["micro_batch"]):
                prefix = int(torch.randint(1, 7, (1,), generator=gen))
                suffix = int(torch.randint(0, 3, (1,), generator=gen))
                labels[s, m, b, :prefix] = IGNORE_INDEX
                if suffix:
                    labels[s, m, b, -suffix:] = IGNORE_INDEX
        counts = [count_items(labels[s, m]) for m in range(t["grad_accum"])]
        if len(set(counts)) == 1:  # force unequal counts: mask the last scored token of micro 0
            row = labels[s, 0, 0]
            row[int((row != IGNORE_INDEX).nonzero().max())] = IGNORE_INDEX
            counts = [count_items(labels[s, m]) for m in range(t["grad_accum"])]
        assert len(set(counts)) > 1, counts
    return ids, labels


# --------------------------------------------------------------------------------------------
# One fixture
# --------------------------------------------------------------------------------------------

def close(a, b, atol, rtol=0.0):
    return torch.allclose(a, b, atol=atol, rtol=rtol)


def make_fixture(out_dir, name, base_name, use_rslora, seed):
    cfg = BASE_CONFIGS[base_name]
    folder = os.path.join(out_dir, name)
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    V = cfg["vocab_size"]
    checks = {}

    # ---- base model --------------------------------------------------------------------------
    base = build_base(cfg, seed)
    base.save_pretrained(folder)  # config.json, generation_config.json, model.safetensors (fp32)
    base_sd = load_file(os.path.join(folder, "model.safetensors"))
    write_legacy_config(folder, base, checks)
    if cfg["tie_word_embeddings"]:
        assert "lm_head.weight" not in base_sd  # HF omits the tied head; keep it that way

    gen = torch.Generator().manual_seed(seed + 4)
    ids, labels = forward_batch(V, gen)
    train_ids, train_labels = train_batches(V, gen)

    with torch.no_grad():
        base_loss = float(base(input_ids=ids, labels=labels).loss)

    # ---- adapter -----------------------------------------------------------------------------
    model = attach_lora(base, use_rslora, seed)
    scaling = model.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"]
    expected_scaling = LORA_ALPHA / (math.sqrt(LORA_R) if use_rslora else LORA_R)
    assert scaling == expected_scaling, (scaling, expected_scaling)
    adapter_dir = os.path.join(folder, "adapter")
    model.save_pretrained(adapter_dir)
    # PEFT stores target_modules from a Python set, so its order in adapter_config.json changes
    # from run to run (string hash randomisation). Sort it so the fixture is reproducible.
    acfg_path = os.path.join(adapter_dir, "adapter_config.json")
    with open(acfg_path) as f:
        acfg = json.load(f)
    acfg["target_modules"] = sorted(acfg["target_modules"])
    write_json(acfg_path, acfg)
    # PEFT also writes a model card README.md with nothing of use to the tests.
    card = os.path.join(adapter_dir, "README.md")
    if os.path.exists(card):
        os.remove(card)
    adapter_sd = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    params = lora_params(model)
    assert sorted(adapter_sd) == sorted(k for k, _ in params), "PEFT key mapping changed"
    assert sorted(adapter_sd) == sorted(get_peft_model_state_dict(model))
    for k, p in params:
        assert torch.equal(adapter_sd[k], p.detach()), k
        if ".lora_A." in k:  # lora_A left at PEFT's kaiming-uniform init: |A| <= 1/sqrt(in)
            assert float(p.detach().abs().max()) <= 1.0 / math.sqrt(p.shape[1]) + 1e-7, k

    # ---- forward + backward ------------------------------------------------------------------
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    # SEMANTICS: without num_items_in_batch, HF's loss is the MEAN over scored tokens.
    out.loss.backward()
    logits = out.logits.detach()
    loss = out.loss.detach()
    grads = {k: p.grad.detach().clone() for k, p in params}
    model.zero_grad(set_to_none=True)

    n_items = count_items(labels)
    # Loss two more ways: (a) explicit shift logits[:, :-1] vs labels[:, 1:], torch mean;
    # (b) sum of token losses / number of scored tokens.
    loss_a = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1),
                             ignore_index=IGNORE_INDEX)
    loss_b = token_loss_sum(logits, labels) / n_items
    checks["forward_loss_explicit_shift"] = float((loss_a - loss).abs())
    checks["forward_loss_sum_over_count"] = float((loss_b - loss).abs())
    assert close(loss_a, loss, 1e-6) and close(loss_b, loss, 1e-6)

    # Reload what was written, the way a user would, and compare logits.
    reloaded_base = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(reloaded_base, adapter_dir).eval()
    with torch.no_grad():
        rl = reloaded(input_ids=ids).logits
        with reloaded.disable_adapter():
            base_loss_disabled = float(reloaded(input_ids=ids, labels=labels).loss)
    checks["reload_logits_max_abs_diff"] = float((rl - logits).abs().max())
    assert close(rl, logits, 1e-6), checks["reload_logits_max_abs_diff"]
    checks["base_loss_disable_adapter_diff"] = abs(base_loss_disabled - base_loss)
    assert checks["base_loss_disable_adapter_diff"] < 1e-6

    # The from-scratch forward must agree with transformers.
    ref = reference_forward(base_sd, adapter_sd, cfg, scaling, ids)
    checks["reference_forward_max_abs_diff"] = float((ref - logits).abs().max())
    assert close(ref, logits, 1e-4), checks["reference_forward_max_abs_diff"]
    inv_freq, band = llama3_inv_freq(cfg["head_dim"], cfg["rope_theta"], cfg.get("rope_scaling"))
    assert torch.equal(inv_freq, reloaded_base.model.rotary_emb.inv_freq), "inv_freq mismatch"
    if band is not None:
        assert "smoothed" in band, band

    zero_grads = [k for k, g in grads.items() if not torch.any(g != 0)]
    assert not zero_grads, zero_grads

    save_file({"input_ids": ids.to(torch.int32).contiguous(), "labels": labels.to(torch.int32).contiguous()},
              os.path.join(folder, "batch.safetensors"), metadata=st_metadata({"fixture": name}))
    fwd = {"logits": logits.contiguous(), "loss": loss.reshape(1).contiguous()}
    fwd.update({k: g.contiguous() for k, g in grads.items()})
    save_file(fwd, os.path.join(folder, "forward.safetensors"),
              metadata=st_metadata({"fixture": name, "num_items": n_items}))
    write_json(os.path.join(folder, "eval.json"), {
        "loss": float(loss),
        "loss_base_no_adapter": base_loss,
        "num_items": n_items,
        "versions": versions(),
    })

    # ---- training ----------------------------------------------------------------------------
    t = TRAIN
    train_params = [p for _, p in params]
    opt = torch.optim.AdamW(train_params, lr=t["lr"], betas=t["betas"], eps=t["eps"],
                            weight_decay=t["weight_decay"])  # one group: A and B both decay
    model.train()
    losses, grad_norms, clip_coefs, items_per_step, items_per_micro = [], [], [], [], []
    after_step1, before_step1, clipped_grads_step1, step1_grads = {}, {}, {}, {}
    for s in range(t["steps"]):
        # SEMANTICS (normalisation, transformers >= 4.46): every micro-batch's token-loss SUM is
        # divided by num_items_in_batch = scored tokens over ALL micro-batches of the optimizer
        # step (not by its own count, and not additionally by grad_accum). Gradients of the
        # micro-batches accumulate, so the step's gradient is d(total sum / total count).
        micro_counts = [count_items(train_labels[s, m]) for m in range(t["grad_accum"])]
        num_items_in_batch = sum(micro_counts)
        step_loss = 0.0
        for m in range(t["grad_accum"]):
            mid, mlab = train_ids[s, m], train_labels[s, m]
            logits_m = model(input_ids=mid).logits
            loss_m = token_loss_sum(logits_m, mlab) / num_items_in_batch
            loss_m.backward()
            step_loss += float(loss_m.detach())
            with torch.no_grad():  # the same number through HF's own loss path
                hf = model(input_ids=mid, labels=mlab, num_items_in_batch=num_items_in_batch).loss
            assert close(hf, loss_m.detach(), 1e-6), (float(hf), float(loss_m))
        with torch.no_grad():
            # Second way: the step's loss equals the plain mean over the micro-batches stacked
            # into one batch (rows are independent; same seq length, so the shift lines up).
            stacked = model(input_ids=train_ids[s].reshape(-1, t["seq"]),
                            labels=train_labels[s].reshape(-1, t["seq"])).loss
        checks.setdefault("train_loss_vs_stacked_batch", 0.0)
        checks["train_loss_vs_stacked_batch"] = max(checks["train_loss_vs_stacked_batch"],
                                                    abs(float(stacked) - step_loss))
        assert abs(float(stacked) - step_loss) < 1e-5, (float(stacked), step_loss)
        # SEMANTICS (clipping): total = ||all grads||_2 (one global norm over every LoRA
        # tensor); coef = min(max_norm / (total + 1e-6), 1); every grad *= coef.
        if s == 0:
            step1_grads = {k: p.grad.detach().clone() for k, p in params}
        total_norm = float(torch.nn.utils.clip_grad_norm_(train_params, t["max_grad_norm"]))
        coef = min(t["max_grad_norm"] / (total_norm + 1e-6), 1.0)
        if s == 0:
            before_step1 = {k: p.detach().clone() for k, p in params}
            clipped_grads_step1 = {k: p.grad.detach().clone() for k, p in params}
        opt.step()
        opt.zero_grad(set_to_none=True)
        if s == 0:
            after_step1 = {k: p.detach().clone() for k, p in params}
        losses.append(step_loss)
        grad_norms.append(total_norm)
        clip_coefs.append(coef)
        items_per_step.append(num_items_in_batch)
        items_per_micro.append(micro_counts)
    model.eval()
    after_step5 = {k: p.detach().clone() for k, p in params}

    # AdamW step 1 by hand (SPECS 8): p *= 1 - lr*wd; m = (1-b1) g; v = (1-b2) g^2;
    # p -= lr/(1-b1) * m / (sqrt(v)/sqrt(1-b2) + eps).
    b1, b2 = t["betas"]
    worst = 0.0
    for k, p0 in before_step1.items():
        g = clipped_grads_step1[k]
        p = p0 * (1 - t["lr"] * t["weight_decay"])
        m1, v1 = (1 - b1) * g, (1 - b2) * g * g
        p = p - t["lr"] / (1 - b1) * m1 / (v1.sqrt() / math.sqrt(1 - b2) + t["eps"])
        worst = max(worst, float((p - after_step1[k]).abs().max()))
    checks["adamw_step1_by_hand_max_abs_diff"] = worst
    assert worst < 1e-6, worst

    tr = {"input_ids": train_ids.to(torch.int32).contiguous(),
          "labels": train_labels.to(torch.int32).contiguous()}
    tr.update({"step1_grad." + k: v.contiguous() for k, v in step1_grads.items()})
    tr.update({"after_step1." + k: v.contiguous() for k, v in after_step1.items()})
    tr.update({"after_step5." + k: v.contiguous() for k, v in after_step5.items()})
    save_file(tr, os.path.join(folder, "train.safetensors"), metadata=st_metadata({"fixture": name}))
    write_json(os.path.join(folder, "train.json"), {
        "optimizer": "torch.optim.AdamW",
        "learning_rate": t["lr"],
        "lr_scheduler": "constant",
        "warmup_steps": 0,
        "adam_beta1": t["betas"][0],
        "adam_beta2": t["betas"][1],
        "adam_epsilon": t["eps"],
        "weight_decay": t["weight_decay"],
        "max_grad_norm": t["max_grad_norm"],
        "gradient_accumulation_steps": t["grad_accum"],
        "per_device_train_batch_size": t["micro_batch"],
        "seq_len": t["seq"],
        "steps": t["steps"],
        "losses": losses,
        "grad_norms": grad_norms,
        "clip_coefs": clip_coefs,
        "num_items_per_step": items_per_step,
        "num_items_per_micro_batch": items_per_micro,
        "versions": versions(),
    })

    # ---- metadata ----------------------------------------------------------------------------
    meta = {
        "fixture": name,
        "seed": seed,
        "initializer_range": INITIALIZER_RANGE,
        "norm_weight_init": f"1 + {NORM_WEIGHT_STD} * randn",
        "lora_A_init": "PEFT kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in))",
        "lora_B_init": f"{LORA_B_STD} * randn (overwrites PEFT's zeros)",
        "lora_r": LORA_R,
        "lora_alpha": LORA_ALPHA,
        "use_rslora": use_rslora,
        "lora_scaling": scaling,
        "rope_inv_freq": inv_freq.tolist(),
        "rope_inv_freq_band": band,
        "attn_implementation": "eager",
        "attention_mask": "none (pure causal)",
        "dtype": "float32",
        "checks": checks,
        "versions": versions(),
    }
    write_json(os.path.join(folder, "meta.json"), meta)

    return {
        "name": name,
        "base": base_name,
        "forward_loss": float(loss),
        "base_loss": base_loss,
        "train_losses": losses,
        "grad_norms": grad_norms,
        "scaling": scaling,
        "band": band,
        "inv_freq": inv_freq.tolist(),
        "num_items": n_items,
        "checks": checks,
        "grad_abs_max": max(float(g.abs().max()) for g in grads.values()),
        "grad_abs_min_tensor": min(float(g.abs().max()) for g in grads.values()),
        "files": sorted(
            (os.path.relpath(os.path.join(r, f), folder), os.path.getsize(os.path.join(r, f)))
            for r, _, fs in os.walk(folder) for f in fs),
    }


# --------------------------------------------------------------------------------------------
# README
# --------------------------------------------------------------------------------------------

def readme(summaries):
    v = versions()
    lines = []
    w = lines.append
    w("# Hugging Face golden fixtures")
    w("")
    w("Written by `tools/make_golden.py`; do not edit by hand. Regenerate with")
    w("")
    w("    pip install -r tools/requirements-golden.txt")
    w("    python3 tools/make_golden.py --out tests/fixtures/golden")
    w("")
    w("Generated with: " + ", ".join(f"{k} {v[k]}" for k in ["python", "torch", "transformers", "peft", "safetensors", "numpy"])
      + " (CPU, one thread, float32, `attn_implementation=\"eager\"`, deterministic algorithms).")
    w("The same versions are in every `meta.json`, `train.json`, `eval.json`, and in the")
    w("`__metadata__` of `batch`, `forward` and `train.safetensors` (one key, `memtune_golden`, a JSON")
    w("string). Regenerating with the same versions gives byte-identical files.")
    w("")
    w("## Fixtures")
    w("")
    w("| folder | model | LoRA scaling | forward loss | base loss (no adapter) |")
    w("|---|---|---|---|---|")
    desc = {
        "gqa_rope": "hidden 64, inter 160, 2 layers, 4 heads / 2 kv heads (GQA), head_dim 16, vocab 300, rope_theta 500000 + llama3 scaling (factor 8, low 1, high 4, original_max_position_embeddings 64), untied",
        "gqa_rope_rslora": "identical to gqa_rope (same seed: same base weights, batches, lora_A, lora_B); only `use_rslora: true`",
        "tied_odd": "hidden 72, inter 200, 2 layers, 3 heads / 1 kv head, head_dim 24, vocab 263, rope_theta 10000, no rope scaling, tied embeddings",
    }
    for s in summaries:
        w(f"| `{s['name']}` | {desc[s['name']]} | {s['scaling']} | {s['forward_loss']:.7f} | {s['base_loss']:.7f} |")
    w("")
    w("All: rms_norm_eps 1e-5, max_position_embeddings 2048, bos 1, eos 2, no biases, SiLU MLP.")
    w(f"Weights: transformers' seeded init with initializer_range {INITIALIZER_RANGE} (0.02 would give")
    w(f"near-uniform logits), then every RMSNorm weight redrawn as 1 + {NORM_WEIGHT_STD}*randn.")
    w(f"LoRA: r {LORA_R}, alpha {LORA_ALPHA}, dropout 0, bias none, targets q,k,v,o,gate,up,down in every layer;")
    w("lora_A left at PEFT's init (kaiming_uniform a=sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))),")
    w(f"lora_B overwritten with {LORA_B_STD}*randn so that the lora_A gradients are non-zero.")
    w("")
    g = next(s for s in summaries if s["name"] == "gqa_rope")
    w("### llama3 RoPE bands in `gqa_rope`")
    w("")
    w("With head_dim 16, theta 500000 and original_max_position_embeddings 64 (low-frequency")
    w("wavelength 64, high-frequency wavelength 16), the 8 inverse frequencies fall as follows")
    w("(fp32 values, also in `meta.json` as `rope_inv_freq`):")
    w("")
    w("| i | inv_freq | band |")
    w("|---|---|---|")
    for i, (f, b) in enumerate(zip(g["inv_freq"], g["band"])):
        w(f"| {i} | {f:.9g} | {b} |")
    w("")
    n_sm = g["band"].count("smoothed")
    w(f"Smoothed band: {n_sm} of 8; unchanged: {g['band'].count('unchanged')}; divided by the factor:")
    w(f"{g['band'].count('divided')}. All three branches of the llama3 formula are exercised.")
    w("The scaling is static: it applies at every position, even though the sequences here (16 and 12)")
    w("are shorter than original_max_position_embeddings.")
    w("")
    w("## Files in each folder")
    w("")
    w("| file | contents |")
    w("|---|---|")
    w("| `config.json` | the HF config exactly as `save_pretrained` (transformers 5.x) writes it. NOTE: RoPE is under `rope_parameters` (with `rope_theta` and `rope_type` inside); there is no top-level `rope_theta` / `rope_scaling` as in configs written by transformers 4.x and in the Meta checkpoints on the Hub. A loader must accept both layouts. |")
    w("| `config_hf4.json` | the same config in the transformers 4.x / Hub layout: top-level `rope_theta` and `rope_scaling` (null for `tied_odd`) instead of `rope_parameters`; transformers 5 reads it back to identical RoPE parameters and inv_freq (checked). For testing that the C++ config reader accepts both layouts. |")
    w("| `generation_config.json` | written by `save_pretrained`; not needed by the tests. |")
    w("| `model.safetensors` | base model weights, fp32, HF key names (`model.embed_tokens.weight`, `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `model.layers.{i}.mlp.{gate,up,down}_proj.weight`, `model.layers.{i}.{input,post_attention}_layernorm.weight`, `model.norm.weight`, `lm_head.weight`). Linear weights are `[out, in]`. For tied embeddings (`tied_odd`) `lm_head.weight` is absent: use `model.embed_tokens.weight`. |")
    w("| `adapter/adapter_config.json` | as PEFT's `save_pretrained` writes it, except `target_modules` sorted (PEFT writes them from a set, in a random order). |")
    w("| `adapter/adapter_model.safetensors` | the LoRA weights before any training, fp32, metadata `{\"format\":\"pt\"}`. Keys `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` (`[r, in]`) and `...lora_B.weight` (`[out, r]`) for q,k,v,o,gate,up,down: 28 tensors. (PEFT's model card README.md is removed.) |")
    w("| `batch.safetensors` | `input_ids` int32 [2, 16], `labels` int32 [2, 16]: labels = input_ids except -100 at row 0 positions 0..3, row 1 positions 0..6 and row 1 position 15. " + f"{summaries[0]['num_items']} scored tokens after the shift (labels[:, 1:] != -100). |")
    w("| `forward.safetensors` | `logits` f32 [2, 16, V]; `loss` f32 [1] (HF mean over scored tokens); and for each of the 28 adapter keys the gradient of `loss` w.r.t. that LoRA weight, same key and shape as in adapter_model.safetensors. |")
    w("| `eval.json` | `loss` (with the adapter; equals forward loss), `loss_base_no_adapter` (same batch, base model alone), `num_items`. |")
    w("| `train.safetensors` | `input_ids` int32 [5, 2, 2, 12] and `labels` int32 [5, 2, 2, 12] as [step, micro, batch, seq]; `step1_grad.<adapter key>` f32: the gradient accumulated over both micro-batches of step 1, before clipping (tests the normalisation apart from the optimizer); `after_step1.<adapter key>` f32: the LoRA weights after optimizer step 1; `after_step5.<adapter key>`: after step 5. |")
    w("| `train.json` | hyperparameters (AdamW lr 1e-2, betas 0.9/0.999, eps 1e-8, weight_decay 0.01 on every LoRA tensor, constant LR, no warmup, grad accumulation 2, micro-batch 2 x 12, max_grad_norm 1.0); `losses` (5, loss of each step before its update), `grad_norms` (5, global L2 norm before clipping), `clip_coefs`, `num_items_per_step`, `num_items_per_micro_batch`. |")
    w("| `meta.json` | seed, init recipe, LoRA scaling, RoPE inv_freq and bands, the self-check residuals, versions. |")
    w("")
    w("## Semantics the fixtures encode")
    w("")
    w("- **Shift.** logits[:, t] predicts labels[:, t+1]; the last logit column is never scored and labels[:, 0] is never a target. HF pads labels with -100 on the right and drops column 0, which equals scoring logits[:, :-1] against labels[:, 1:].")
    w("- **-100** labels are skipped and not counted. No attention mask is used: masked label positions are still attended to (pure causal attention).")
    w("- **Forward loss** = sum of token cross-entropies (fp32 log-softmax) / number of scored tokens.")
    w("- **Accumulation.** For each optimizer step, num_items_in_batch = scored tokens summed over both micro-batches. Each micro-batch's loss is its token-loss SUM / num_items_in_batch (no further division by the accumulation count); gradients accumulate; the step's reported loss is the sum over micro-batches, which equals the plain mean over both micro-batches stacked together. The per-step counts differ between micro-batches, so a per-micro-batch mean would give different numbers.")
    w("- **Clipping.** One global L2 norm over all LoRA gradients; coef = min(1, max_norm / (norm + 1e-6)); every gradient is multiplied by coef (torch.nn.utils.clip_grad_norm_). `grad_norms` is the norm before clipping. The pre-clip norms are 2 to 5, so clipping is active at every step of every fixture.")
    w("- **AdamW** (torch): p *= 1 - lr*wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps). Weight decay applies to both lora_A and lora_B. The script checks step 1 against this formula by hand.")
    w("- **LoRA.** y = W x + scaling * B (A x), scaling = alpha/r (2.0), or alpha/sqrt(r) (4.0) with rslora.")
    w("- **RMSNorm.** w * (x * rsqrt(mean(x^2) + eps)); HF casts the normalised x back to the input dtype before multiplying by w (matters in bf16 only).")
    w("- **RoPE.** inv_freq = 1/theta^(arange(0, d, 2)/d) in fp32 (then llama3 scaling); angles = position * inv_freq in fp32; cos/sin of cat(freqs, freqs); rotate_half(x) = cat(-x2, x1) on the two halves (not interleaved pairs). cos/sin are cast to the activation dtype before use.")
    w("- **Attention.** scale head_dim^-0.5; kv head j serves query heads j*g..j*g+g-1 (repeat_interleave, g = heads/kv_heads); softmax in fp32.")
    w("- **Keys.** In memory PEFT names a LoRA weight `...q_proj.lora_A.default.weight`; the saved key drops the adapter name (`...q_proj.lora_A.weight`). Gradient keys in forward.safetensors use the saved form.")
    w("")
    w("## Comparing")
    w("")
    w("The script's own from-scratch fp32 forward reproduces HF's logits bit for bit on one CPU thread,")
    w("so an fp32 C++ engine with a different summation order should land within about 1e-5 relative")
    w("on logits and loss and 1e-4 on gradients and post-step weights. `after_step1` is the tightest")
    w("optimizer test (one AdamW step, where m/sqrt(v) is about +-1 per element, so every weight moves by")
    w("about lr = 1e-2); `after_step5` and `losses` test the accumulated state. Caveat: because the first")
    w("step moves a weight by about lr * sign(g), a gradient element that is near zero (each fixture has")
    w("a few |step1_grad| below 1e-5, the smallest about 7e-8, against a largest of 0.2 to 0.5) can flip")
    w("sign under fp32 noise and then differ by up to 2 * lr. Compare such elements loosely, or leave")
    w("them out.")
    w("")
    w("## Self-checks run by the script")
    w("")
    w("The adapter folder is reloaded with `PeftModel.from_pretrained` and its logits must match; the")
    w("forward loss is recomputed two more ways (explicit shift + mean, sum / count); every micro-batch")
    w("loss is recomputed through HF's own loss with `num_items_in_batch`; each step's loss is compared")
    w("with the mean over the stacked micro-batches; AdamW step 1 is redone by hand; a from-scratch")
    w("forward (`reference_forward`) built only from the written files must match HF's logits; no LoRA")
    w("gradient tensor may be all zero. The residuals are in each `meta.json` under `checks`.")
    w("")
    w("## Sizes")
    w("")
    w("| file | bytes |")
    w("|---|---|")
    for s in summaries:
        for f, n in s["files"]:
            w(f"| `{s['name']}/{f}` | {n} |")
    w("")
    return "\n".join(lines)


def families_readme(summaries):
    """FAMILIES.md: the fixtures of the families beyond Llama. Their files are laid out as the
    Llama fixtures' (README.md), plus the family's own base tensors in model.safetensors."""
    v = versions()
    lines = ["# Golden fixtures of the families beyond Llama", "",
             "Written by `tools/make_golden.py`; do not edit by hand. Regenerate with", "",
             "    python3 tools/make_golden.py --out tests/fixtures/golden --only "
             + ",".join(s["name"] for s in summaries), "",
             "Generated with: " + ", ".join(f"{k} {v[k]}" for k in ["python", "torch", "transformers", "peft"])
             + " (CPU, one thread, float32, eager attention). Files as described in README.md.", "",
             "| folder | model_type | sizes | what it exercises | forward loss |", "|---|---|---|---|---|"]
    what = {
        "qwen2": "frozen q/k/v biases (redrawn as %g * randn), added before the LoRA term; tied embeddings" % BIAS_STD,
        "qwen3": "per-head RMSNorm on q and k (q_norm / k_norm weights redrawn around 1) before RoPE",
        "mistral": "explicit head_dim; sliding_window %d",
    }
    for s in summaries:
        c = BASE_CONFIGS[s["base"]]
        sizes = (f"hidden {c['hidden_size']}, inter {c['intermediate_size']}, {c['num_hidden_layers']} layers, "
                 f"{c['num_attention_heads']} heads / {c['num_key_value_heads']} kv, head_dim {c['head_dim']}, "
                 f"vocab {c['vocab_size']}, {'tied' if c['tie_word_embeddings'] else 'untied'}")
        exercises = what[c["model_type"]]
        if c["model_type"] == "mistral":
            reach = c["sliding_window"] < 12  # the training rows, the shorter of the two
            exercises = exercises % c["sliding_window"] + (
                ", shorter than the rows: keys that far back are masked" if reach
                else ", longer than every row (the mask is causal only)")
        lines.append(f"| `{s['name']}` | {c['model_type']} | {sizes} | {exercises} | {s['forward_loss']:.8g} |")
    lines += ["", "Every family fixture also checks, in the script, that a from-scratch forward "
              "(`reference_forward`) equals transformers' logits, and PEFT's reload.", ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/fixtures/golden", help="output folder")
    ap.add_argument("--only", default="", help="comma-separated fixture folders to write (README.md untouched)")
    args = ap.parse_args()
    only = [n for n in args.only.split(",") if n]
    unknown = set(only) - {f[0] for f in FIXTURES}
    if unknown:
        ap.error(f"unknown fixtures {sorted(unknown)}")

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)
    transformers.logging.set_verbosity_error()

    os.makedirs(args.out, exist_ok=True)
    summaries = [make_fixture(args.out, *f) for f in FIXTURES if not only or f[0] in only]
    if not only:
        with open(os.path.join(args.out, "README.md"), "w") as f:
            f.write(readme(summaries))
    family_summaries = [s for s in summaries if model_type_of(BASE_CONFIGS[s["base"]]) != "llama"]
    if family_summaries:
        with open(os.path.join(args.out, "FAMILIES.md"), "w") as f:
            f.write(families_readme(family_summaries))

    print("versions:", json.dumps(versions()))
    for s in summaries:
        print(f"\n[{s['name']}] scaling={s['scaling']}")
        print(f"  forward loss          {s['forward_loss']:.9g}")
        print(f"  base loss (no LoRA)   {s['base_loss']:.9g}")
        print(f"  train losses          {[round(x, 7) for x in s['train_losses']]}")
        print(f"  pre-clip grad norms   {[round(x, 7) for x in s['grad_norms']]}")
        print(f"  |grad| max {s['grad_abs_max']:.3g}, smallest per-tensor max {s['grad_abs_min_tensor']:.3g}")
        if s["band"]:
            print(f"  rope bands            {s['band']}")
        print("  checks                " + ", ".join(f"{k}={v:.2e}" for k, v in s["checks"].items()))
        total = 0
        for f, n in s["files"]:
            print(f"    {n:>8}  {f}")
            total += n
        print(f"    {total:>8}  total")
    print("\nall checks passed")


if __name__ == "__main__":
    sys.exit(main())
