"""Tiny models for the CPU server: built locally, deterministic, cached in an ignored directory.

`--load-format dummy` draws every tensor, norms included, in +-1e-3 with one fixed seed: the
model then ignores its context and T=0 equality proves nothing. So each model here is a HF
directory (config.json, a tokenizer trained with `tokenizers`, model.safetensors) whose float32
weights come from a seeded generator: norms 1, projections ~N(0, 1/fan_in), embeddings ~N(0, 1),
so attention and outputs depend on the context and greedy choices have clear margins.

    dense  LlamaForCausalLM, 2 layers, hidden 64, 4 heads / 2 KV heads, vocab 1024
    swa    MellumForCausalLM, layers sliding/full/sliding/full, sliding_window 32 (hybrid SWA)

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

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
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

RECIPES = {
    "dense": ModelRecipe("dense", "LlamaConfig", "LlamaForCausalLM",
                         dict(_COMMON, num_hidden_layers=2)),
    "swa": ModelRecipe("swa", "MellumConfig", "MellumForCausalLM",
                       dict(_COMMON, num_hidden_layers=4, sliding_window=32,
                            layer_types=["sliding_attention", "full_attention",
                                         "sliding_attention", "full_attention"],
                            mlp_layer_types=["dense"] * 4)),
}


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("DSV41CPU_CACHE") or REPO_ROOT / ".cache" / "cpu-models")


def ensure_model(name: str) -> pathlib.Path:
    """The model directory for `name` ("dense" or "swa"), building it once (file-locked)."""
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


def _build_tokenizer(out: pathlib.Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB:
        raise RuntimeError(f"tokenizer trained to {tok.get_vocab_size()} tokens, expected {VOCAB}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=MAX_POSITIONS)
    fast.save_pretrained(str(out))


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

    config = getattr(transformers, recipe.config_class)(**recipe.config)
    config.architectures = [recipe.model_class]
    config.save_pretrained(str(out))
    _build_tokenizer(out)
    save_file(_weights(recipe, config), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "dsv41-recipe.json").write_text(json.dumps(
        {"name": recipe.name, "digest": recipe.digest(), "recipe_version": RECIPE_VERSION,
         "seed": SEED, "config": recipe.config}, indent=2, sort_keys=True) + "\n")
