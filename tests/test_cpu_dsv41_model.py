"""The tiny DeepSeek-V4.1 recipe (adapter/cpu/models.py `dsv41`): its config.json is the engine's
own DeepseekV41Config (every V4.1 field written out), it satisfies the decoder bounded replay's
assertions (sglang/srt/models/deepseek_v4.py DeepseekV4Model, read in 0.5.23), and its
checkpoint names are the ones the V4.1 modules hold (dsv41_sparse.py). The loader's every-weight
check runs at each boot (tests/e2e/test_e2e_dsv41.py)."""
import pytest

from adapter.cpu import models

CFG = models.DSV41_CONFIG


@pytest.fixture(scope="module")
def config_json():
    return models._dsv41_config_json(dict(CFG, architectures=["DeepseekV41ForCausalLM"]))


def test_config_goes_through_the_engines_deepseek_v41_config(config_json):
    from sglang.srt.configs.deepseek_v41 import DeepseekV41Config

    assert config_json["model_type"] == "deepseek_v41"
    assert config_json["architectures"] == ["DeepseekV41ForCausalLM"]
    loaded = DeepseekV41Config(**config_json)
    assert loaded.architectures == ["DeepseekV4ForCausalLM"]     # the engine's rewrite
    for field in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
                  "candidate_source_layer_id", "candidate_topk_blocks", "candidate_block_size",
                  "hc_pre_from_prev_sublayer", "q_head_norm", "engram_layer_ids", "vision_n_layers",
                  "num_hash_layers", "index_topk"):
        assert getattr(loaded, field) == CFG[field], field
    assert loaded.first_k_dense_replace == 0        # not transformers' V3 default (3)


def test_recipe_satisfies_the_decoder_bounded_replays_assertions():
    last_source = max(CFG["kv_source_layer_ids"])
    assert last_source in CFG["index_source_layer_ids"]
    assert CFG["candidate_source_layer_id"] in (-1, last_source)
    assert set(CFG["compress_ratios"][last_source + 1:CFG["num_hidden_layers"]]) <= {0, 1}
    assert CFG["num_hash_layers"] <= last_source
    assert last_source not in CFG["engram_layer_ids"]
    # non-trivial: both low ratios, a layer sharing a source, a candidate consumer
    assert {1, 2} <= set(CFG["compress_ratios"])
    assert any(r in (1, 2) and i not in CFG["kv_source_layer_ids"]
               for i, r in enumerate(CFG["compress_ratios"]))
    assert any(i > CFG["candidate_source_layer_id"] for i in CFG["index_source_layer_ids"])


def test_checkpoint_names_follow_the_v41_modules():
    shapes = models.dsv4_checkpoint_shapes(CFG)
    assert not any(k.startswith("model.hc_head_") for k in shapes)       # pre-mix from prev
    c1, c2 = "model.layers.1.self_attn.compressor.", "model.layers.2.self_attn.compressor."
    assert {c1 + "wkv.weight", c1 + "wgate.weight", c1 + "norm.weight"} <= shapes.keys()
    assert c2 + "wkv.weight" in shapes and c2 + "wgate.weight" not in shapes     # ratio 1: no gate
    assert not any(".compressor.ape" in k for k in shapes if ".layers.1." in k or ".layers.2." in k)
    assert not any("layers.3.self_attn.compressor" in k for k in shapes)         # shares layer 2's
    for i in (1, 2):
        assert f"model.layers.{i}.self_attn.indexer.wk.weight" in shapes
        assert shapes[f"model.layers.{i}.self_attn.indexer.wk.weight"] == (128, 512)
    assert "model.layers.3.self_attn.indexer.wq_b.weight" in shapes
    assert "model.layers.3.self_attn.indexer.wk.weight" not in shapes            # reads layer 2's
    assert models.RECIPES["dsv41"].digest() != models.RECIPES["dsv4"].digest()
