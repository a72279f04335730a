"""Tiny models for the CPU server: built locally, deterministic, cached in an ignored directory.

`--load-format dummy` draws every tensor, norms included, in +-1e-3 with one fixed seed: the
model then ignores its context and T=0 equality proves nothing. So each model here is a HF
directory (config.json, a tokenizer trained with `tokenizers`, model.safetensors) whose float32
weights come from a seeded generator: norms 1, projections ~N(0, 1/fan_in), embeddings ~N(0, 1),
so attention and outputs depend on the context and greedy choices have clear margins.

    dense  LlamaForCausalLM, 2 layers, hidden 64, 4 heads / 2 KV heads, vocab 1024
    swa    MellumForCausalLM, layers sliding/full/sliding/full, sliding_window 32 (hybrid SWA)
    dsv4   DeepseekV4ForCausalLM, 3 layers with compress ratios 0/4/128 (window 128, page 256),
           hidden 256, 8 heads x 512 (448 nope + 64 rope), indexer 4 x 128, MoE 8 routed + 1 shared
           top-2 (layer 0 hash-routed), mHC x4; written under the checkpoint names the engine's
           `load_weights` reads, with DeepSeek's special tokens in the tokenizer
    dsv41  DeepSeek-V4.1 (`model_type` deepseek_v41, the engine's own DeepseekV41Config), 4 layers
           with compress ratios 0/2/1/1: kv- and index-source layers 1 (ratio 2) and 2 (ratio 1),
           layer 2 the candidate source (8 blocks of 64), layer 3 a ratio-1 layer reading layer
           2's latents and top-k; mHC pre-mix from the previous sublayer; the dsv4 sizes otherwise

Built on first use into <repo>/.cache/cpu-models/<name>-<digest>/ (or $DSV41CPU_CACHE); the
digest covers the recipe, so a recipe change builds a new directory.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import tempfile

RECIPE_VERSION = 1
VOCAB = 1024
SEED = 20261203
MAX_POSITIONS = 32768


@dataclasses.dataclass(frozen=True)
class ModelRecipe:
    name: str
    config_class: str           # transformers config class
    model_class: str            # transformers model class (meta device: parameter names/shapes)
    config: dict

    def digest(self) -> str:
        blob = json.dumps([RECIPE_VERSION, SEED, VOCAB, self.config_class, self.config], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=MAX_POSITIONS,
               rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
               torch_dtype="float32")

# The tiny DeepSeek-V4 (SPEC "A whole DeepSeek-V4 in the real server on CPU"). head_dim 512 = 448 +
# 64 is fixed by the V4 pool row; window 128 and the engine's page 256 are the cluster's. A prompt
# past 128 tokens already leaves the SWA window, so cone's lost-window resume needs only small pools.
# Cost on CPU (bench/dsv4_cpu.py; the engine's torch sparse attention gathers and dequantises every
# index row per query token): a c4 layer reads 128 SWA + 512 (index_topk, which the backend pins to
# 512 or 1024) rows per token, a c128 layer 128 + 64, a ratio-0 layer 128; a c4 layer's prefill
# chunk took 4-6x a ratio-0 layer's. So one layer of each ratio (was 0/4/128/4). The context length
# (max_position_embeddings) sizes req_to_token, whose width the decode metadata uses for the
# indexer logits (width/4 columns per c4 layer) and the c128 page table: 8192 = the default
# --max-total-tokens (was 32768). YaRN keeps its original 8192 x factor 4: the compressed layers'
# rope (precompute_freqs_cis) is the same for every position below 8192.
DSV4_CONFIG = dict(
    model_type="deepseek_v4", vocab_size=VOCAB, hidden_size=256, num_hidden_layers=3,
    compress_ratios=[0, 4, 128], num_attention_heads=8, num_key_value_heads=1,
    qk_nope_head_dim=448, qk_rope_head_dim=64, v_head_dim=512, kv_lora_rank=512, q_lora_rank=128,
    o_lora_rank=64, o_groups=2, index_n_heads=4, index_head_dim=128, index_topk=512,
    window_size=128, sliding_window=128, head_dim=512, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    moe_intermediate_size=128, intermediate_size=256, scoring_func="sqrtsoftplus",
    topk_method="noaux_tc", n_group=1, topk_group=1, routed_scaling_factor=1.5,
    norm_topk_prob=True, num_hash_layers=1, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    rms_norm_eps=1e-6, rope_theta=10000, compress_rope_theta=40000,
    max_position_embeddings=8192,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    torch_dtype="bfloat16")
# DeepSeek's special tokens (what deepseek-recipe renders; the engine's image placeholder too).
DSV4_SPECIAL_TOKENS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>",
                       "<｜Assistant｜>", "<｜System｜>", "<think>", "</think>",
                       "<｜latest_reminder｜>", "<｜image｜>", "<｜deepseek_image｜>", "<｜box｜>",
                       "<｜/box｜>", "<｜point｜>", "<｜/point｜>", "<｜polygon｜>", "<｜/polygon｜>",
                       "<｜ref｜>", "<｜/ref｜>"]

# The tiny DeepSeek-V4.1 (SPEC "DeepSeek-V4.1 in the pinned engine"): the tiny V4 above made a
# `deepseek_v41` through the engine's own DeepseekV41Config (a DeepseekV3Config: it accepts the
# V4.1 ratios 1 and 2, which the native V4 config rejects). What the engine reads of it:
# - compress_ratios 0/2/1/1: a ratio-0 layer (hash-routed, as num_hash_layers 1 needs before the
#   late layers), then the V4.1 low-ratio layers (dsv41_sparse.py: DeepseekV41Compressor, no ape;
#   DeepseekV41Indexer, fp4 index keys).
# - kv_source_layer_ids [1, 2]: layers 1 (ratio 2) and 2 (ratio 1) own compressed latents; layer
#   3 (ratio 1) shares layer 2's (the pool has one ratio-1 and one ratio-2 layer).
# - index_source_layer_ids [1, 2, 3]: layers 1 and 2 own their index keys (wk, k_norm: they are
#   kv sources); layer 3's indexer scores layer 2's keys with its own queries (wq_b,
#   weights_proj) and, as a later layer than the candidate source, consumes its candidates.
# - candidate_source_layer_id 2, candidate_topk_blocks 8 x candidate_block_size 64 (512 = the
#   index_topk): on CPU the engine takes its dense-block candidate scheme (v41_indexer
#   make_candidate_indexer: the DeepGEMM sparse table needs SM100+).
# - --enable-decoder-swa-bounded-replay (the harness sets it, see adapter/cpu/server.py) asserts
#   (deepseek_v4.py DeepseekV4Model): the last kv source (2) is also an index source and the
#   candidate source, later layers compress at ratio 0 or 1 only (layer 3: 1), hash layers
#   (1) come before late_layer_start (2). The late layers are 2 and 3.
# - hc_pre_from_prev_sublayer (V4.1's default, True): no hc_head parameters; each sublayer's mHC
#   pre-mix comes from the previous one (the engine's torch HcSubLayer on CPU).
# - q_head_norm False (V4.1's default: the q path ropes without a per-head norm; True is V4's path,
#   which the dsv4 model runs through the fused_q_norm_rope stand-in).
# Off: engram (engram_layer_ids empty). Not attempted: its tables are fp8 with e8m0 block scales
# (EngramEmbedding), its wkv block-quantized, its hasher builds a compressed vocabulary from the
# tokenizer's normalizers and keeps per-request n-gram history; whether that runs on CPU is open.
# The vision tower is off (vision_n_layers 0). Cost: ratio-1/2 layers keep every compressed
# position (1 or 2 tokens per latent); 4 layers keep a boot near the dsv4 one.
DSV41_CONFIG = dict(
    DSV4_CONFIG, model_type="deepseek_v41", num_hidden_layers=4, compress_ratios=[0, 2, 1, 1],
    kv_source_layer_ids=[1, 2], index_source_layer_ids=[1, 2, 3], candidate_source_layer_id=2,
    candidate_topk_blocks=8, candidate_block_size=64, hc_pre_from_prev_sublayer=True,
    q_head_norm=False, engram_layer_ids=[], vision_n_layers=0, first_k_dense_replace=0)

RECIPES = {
    "dense": ModelRecipe("dense", "LlamaConfig", "LlamaForCausalLM",
                         dict(_COMMON, num_hidden_layers=2)),
    "swa": ModelRecipe("swa", "MellumConfig", "MellumForCausalLM",
                       dict(_COMMON, num_hidden_layers=4, sliding_window=32,
                            layer_types=["sliding_attention", "full_attention",
                                         "sliding_attention", "full_attention"],
                            mlp_layer_types=["dense"] * 4)),
    "dsv4": ModelRecipe("dsv4", "DeepSeekV4Config", "DeepseekV4ForCausalLM", DSV4_CONFIG),
    "dsv41": ModelRecipe("dsv41", "DeepseekV41Config", "DeepseekV41ForCausalLM", DSV41_CONFIG),
}
DEEPSEEK = ("dsv4", "dsv41")        # written without transformers' classes (_build_dsv4)


def cache_root() -> pathlib.Path:
    # the checkout's .cache/, or the user's cache directory for an installed wheel
    from adapter import locations

    return pathlib.Path(os.environ.get("DSV41CPU_CACHE") or locations.cache_dir() / "cpu-models")


def ensure_model(name: str) -> pathlib.Path:
    """The model directory for `name` (a RECIPES key), building it once (file-locked)."""
    if name not in RECIPES:
        raise ValueError(f"unknown CPU model {name!r}; choose one of {', '.join(RECIPES)}")
    recipe = RECIPES[name]
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{name}-{recipe.digest()}"
    if (target / "model.safetensors").is_file():
        return target
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "model.safetensors").is_file():
            tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
            try:
                _build(recipe, tmp)
                if target.exists():
                    shutil.rmtree(target)
                tmp.rename(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


# A fixed corpus for the tokenizer: words drawn from a seeded generator, plus digits and prose,
# so that any text (ByteLevel) encodes and frequent words get their own tokens.
def _corpus(n_lines: int = 4000) -> list[str]:
    import random

    rng = random.Random(SEED)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "qu", "the", "and", "ion",
                 "er", "st", "ing", "an", "re", "on", "at"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(600)]
    prose = ("The scheduler admits a request, the radix cache matches its prefix, and the model "
             "decodes one token per step while a long prompt prefills in chunks. ")
    lines = [prose]
    for _ in range(n_lines):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 16)))
                     + f" {rng.randint(0, 99999)}.")
    return lines


def _build_tokenizer(out: pathlib.Path, special_tokens=("<pad>", "<s>", "</s>"), bos="<s>",
                     eos="</s>", pad="<pad>") -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB:
        raise RuntimeError(f"tokenizer trained to {tok.get_vocab_size()} tokens, expected {VOCAB}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                   pad_token=pad, model_max_length=MAX_POSITIONS)
    fast.save_pretrained(str(out))


def resolve_transformers_names() -> None:
    """Look up, in the calling thread, every transformers name the harness and its tests resolve
    (each recipe's config and model class, the tokenizer classes). transformers' lazy module is
    not safe on a first lookup that races another thread's import of its submodules: in an e2e
    session whose background boot lane was loading a tokenizer, the main thread's
    `getattr(transformers, "LlamaConfig")` raised AttributeError (seen once, beside a loaded
    machine). The e2e session calls this before its lane starts; looked up once, a name stays."""
    import transformers

    for recipe in RECIPES.values():
        if recipe.name in DEEPSEEK:
            continue        # written without transformers' classes (_build_dsv4)
        getattr(transformers, recipe.config_class)
        getattr(transformers, recipe.model_class)
    transformers.AutoTokenizer, transformers.PreTrainedTokenizerFast, transformers.AutoConfig


def _weights(recipe: ModelRecipe, config) -> dict:
    import torch
    import transformers

    with torch.device("meta"):
        meta = getattr(transformers, recipe.model_class)(config)
    gen = torch.Generator().manual_seed(SEED)
    tensors = {}
    for name, param in sorted(meta.state_dict().items()):
        shape = tuple(param.shape)
        if name.endswith("norm.weight"):
            value = torch.ones(shape)
        elif "embed_tokens" in name:
            value = torch.randn(shape, generator=gen)
        elif len(shape) == 2:
            value = torch.randn(shape, generator=gen) / shape[1] ** 0.5
            if name == "lm_head.weight":
                value = value * 4.0        # peaked next-token distributions: clear greedy margins
        else:
            raise RuntimeError(f"no init rule for {name} {shape}")
        tensors[name] = value.contiguous()
    return tensors


def _build(recipe: ModelRecipe, out: pathlib.Path) -> None:
    import transformers
    from safetensors.torch import save_file

    if recipe.name in DEEPSEEK:
        _build_dsv4(recipe, out)
        return

    config = getattr(transformers, recipe.config_class)(**recipe.config)
    config.architectures = [recipe.model_class]
    config.save_pretrained(str(out))
    _build_tokenizer(out)
    save_file(_weights(recipe, config), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "dsv41-recipe.json").write_text(json.dumps(
        {"name": recipe.name, "digest": recipe.digest(), "recipe_version": RECIPE_VERSION,
         "seed": SEED, "config": recipe.config}, indent=2, sort_keys=True) + "\n")


# --- dsv4 -------------------------------------------------------------------------------------

def dsv4_checkpoint_shapes(config: dict) -> dict:
    """{checkpoint name: shape} of the tiny DeepSeek-V4 / V4.1, in the names `load_weights` remaps (the
    engine fuses wq_a + wkv into wqkv_a, a compressor's wkv + wgate into wkv_gate, gate_proj +
    up_proj into gate_up_proj / the experts' w13)."""
    h, v = config["hidden_size"], config["vocab_size"]
    heads, hd = config["num_attention_heads"], 512
    q_lora, o_lora, groups = config["q_lora_rank"], config["o_lora_rank"], config["o_groups"]
    hc, inter = config["hc_mult"], config["moe_intermediate_size"]
    ih, idim = config["index_n_heads"], config["index_head_dim"]
    mix = (2 + hc) * hc
    v41 = config["model_type"] == "deepseek_v41"
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              "lm_head.weight": (v, h)}
    if not (v41 and config["hc_pre_from_prev_sublayer"]):
        # the LM-head mixer; V4.1's pre-mix from the previous sublayer has none
        shapes.update({"model.hc_head_fn": (hc, hc * h), "model.hc_head_base": (hc,),
                       "model.hc_head_scale": (1,)})
    for i, ratio in enumerate(config["compress_ratios"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "hc_attn_fn": (mix, hc * h), p + "hc_ffn_fn": (mix, hc * h),
            p + "hc_attn_base": (mix,), p + "hc_ffn_base": (mix,),
            p + "hc_attn_scale": (3,), p + "hc_ffn_scale": (3,),
            p + "self_attn.attn_sink": (heads,), p + "self_attn.wq_a.weight": (q_lora, h),
            p + "self_attn.wkv.weight": (hd, h), p + "self_attn.q_norm.weight": (q_lora,),
            p + "self_attn.wq_b.weight": (heads * hd, q_lora), p + "self_attn.kv_norm.weight": (hd,),
            p + "self_attn.wo_a.weight": (groups * o_lora, heads * hd // groups),
            p + "self_attn.wo_b.weight": (h, groups * o_lora),
            p + "mlp.gate.weight": (config["n_routed_experts"], h),
            p + "mlp.shared_experts.gate_proj.weight": (inter, h),
            p + "mlp.shared_experts.up_proj.weight": (inter, h),
            p + "mlp.shared_experts.down_proj.weight": (h, inter)})
        if i < config["num_hash_layers"]:
            shapes[p + "mlp.gate.tid2eid"] = (v, config["num_experts_per_tok"])
        else:
            shapes[p + "mlp.gate.e_score_correction_bias"] = (config["n_routed_experts"],)
        for e in range(config["n_routed_experts"]):
            shapes.update({f"{p}mlp.experts.{e}.gate_proj.weight": (inter, h),
                           f"{p}mlp.experts.{e}.up_proj.weight": (inter, h),
                           f"{p}mlp.experts.{e}.down_proj.weight": (h, inter)})
        compressors = []
        if ratio:
            compressors.append((p + "self_attn.compressor.", hd, ratio))
        if ratio == 4:
            compressors.append((p + "self_attn.indexer.compressor.", idim, ratio))
            shapes.update({p + "self_attn.indexer.wq_b.weight": (ih * idim, q_lora),
                           p + "self_attn.indexer.weights_proj.weight": (ih, h)})
        if ratio in (1, 2):
            # V4.1 (dsv41_sparse.py): only a kv source owns a compressor (wkv, + wgate at ratio
            # 2: CPU keeps the split layout, fused_low_ratio_compress_supported() is False; no
            # ape), only an index source an indexer (wk + k_norm when it also owns the latents)
            compressors = []
            if i in config["kv_source_layer_ids"]:
                c = p + "self_attn.compressor."
                shapes.update({c + "wkv.weight": (hd, h), c + "norm.weight": (hd,)})
                if ratio == 2:
                    shapes[c + "wgate.weight"] = (hd, h)
            if i in config["index_source_layer_ids"]:
                x = p + "self_attn.indexer."
                shapes.update({x + "wq_b.weight": (ih * idim, q_lora), x + "weights_proj.weight": (ih, h)})
                if i in config["kv_source_layer_ids"]:
                    shapes.update({x + "wk.weight": (idim, hd), x + "k_norm.weight": (idim,)})
        for c, dim, r in compressors:
            coff = 2 if r == 4 else 1
            shapes.update({c + "ape": (r, coff * dim), c + "wkv.weight": (coff * dim, h),
                           c + "wgate.weight": (coff * dim, h), c + "norm.weight": (dim,)})
    return shapes


def _dsv4_weights(config: dict) -> dict:
    """Seeded weights with the scales the other models use (norms 1, projections ~N(0, 1/fan_in),
    embeddings ~N(0, 1), lm_head x4), plus: mHC mixes, sinks, ape and biases small so every
    stream and every token of a compressed group count; hash routes distinct experts per token."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    tensors = {}
    for name, shape in sorted(dsv4_checkpoint_shapes(config).items()):
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            value = torch.ones(shape)
        elif name.endswith("tid2eid"):
            n_exp = config["n_routed_experts"]
            first = torch.randint(0, n_exp, (shape[0],), generator=gen)
            step = torch.randint(1, n_exp, (shape[0],), generator=gen)
            value = torch.stack([first, (first + step) % n_exp], dim=1).to(torch.int32)
        elif name.endswith("embed_tokens.weight"):
            value = torch.randn(shape, generator=gen)
        elif name.endswith(("hc_attn_scale", "hc_ffn_scale", "hc_head_scale")):
            value = torch.full(shape, 0.5)
        elif name.endswith(("hc_attn_base", "hc_ffn_base", "hc_head_base", "attn_sink", "ape",
                            "e_score_correction_bias")):
            value = torch.randn(shape, generator=gen) * 0.1
        elif len(shape) == 2:
            value = torch.randn(shape, generator=gen) / shape[1] ** 0.5
            if name == "lm_head.weight":
                value = value * 4.0
        else:
            raise RuntimeError(f"no init rule for {name} {shape}")
        tensors[name] = value.contiguous()
    return tensors


def _dsv41_config_json(config: dict) -> dict:
    """config.json of the tiny V4.1, built through the engine's own DeepseekV41Config (what the
    engine loads it with: transformers' DeepseekV3Config underneath, rope_scaling as
    rope_parameters), every V4.1 field written out; the checkpoint's architecture name
    DeepseekV41ForCausalLM, which the engine rewrites to DeepseekV4ForCausalLM on load."""
    from adapter.cpu import cpu_engine

    cpu_engine.install_torchvision_shim()       # sglang.srt.configs imports torchvision
    from sglang.srt.configs.deepseek_v41 import DeepseekV41Config

    values = DeepseekV41Config(**config).to_dict()
    values.update({k: v for k, v in config.items() if k not in values})   # class-level defaults
    values["architectures"] = list(config["architectures"])
    values.pop("_name_or_path", None)
    values.pop("transformers_version", None)
    return values


def _build_dsv4(recipe: ModelRecipe, out: pathlib.Path) -> None:
    from safetensors.torch import save_file

    config = dict(recipe.config, architectures=[recipe.model_class])
    if recipe.config["model_type"] == "deepseek_v41":
        config = _dsv41_config_json(config)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special = DSV4_SPECIAL_TOKENS
    _build_tokenizer(out, special_tokens=special, bos=special[0], eos=special[1], pad=special[2])
    save_file(_dsv4_weights(recipe.config), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "dsv41-recipe.json").write_text(json.dumps(
        {"name": recipe.name, "digest": recipe.digest(), "recipe_version": RECIPE_VERSION,
         "seed": SEED, "config": recipe.config}, indent=2, sort_keys=True) + "\n")
