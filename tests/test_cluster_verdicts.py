"""`dsv41 check`'s view of the cluster (adapter/tools/cluster.py): the engine's own resolver, run for
DeepSeek-V4.1 under a CUDA (GB10) platform override, and each adapter's verdict on what it resolves.
The resolver is the engine's (`validate_deepseek_v41_features`, its cuda-graph resolution); only the
platform facts and the model type are supplied, as the cluster has them."""
import pytest

from conftest import REPO_ROOT

from adapter.tools import canary, cluster, profile

PROFILE = REPO_ROOT / ".env.tp4.example"


def _line(name="production"):
    line = profile.load_line(PROFILE, name)
    keys, _, _ = canary.split_line(line)
    return {**keys, **{k: v for k, v in line.env.items() if not k.startswith("DSV41_")}}, list(line.args)


@pytest.fixture(scope="module")
def engine():
    from adapter.cpu import cpu_engine

    cpu_engine.install_torchvision_shim()


def test_the_production_line_resolves_the_decoder_replay_on_for_v41_on_cuda(engine):
    _, argv = _line()
    resolved = cluster.resolve(argv)
    assert resolved["enable_decoder_swa_bounded_replay"] is True       # the engine's default there
    assert resolved["decoder_replay_set_on_line"] is False
    assert resolved["enable_encoder_swa_bounded_replay"] is False
    assert resolved["chunked_prefill_size"] == 8192 and "error" not in resolved


def test_the_line_can_turn_it_off_and_on_explicitly(engine):
    _, argv = _line()
    off = cluster.resolve(argv + ["--no-enable-decoder-swa-bounded-replay"])
    assert off["enable_decoder_swa_bounded_replay"] is False and off["decoder_replay_set_on_line"]
    on = cluster.resolve(argv + ["--enable-decoder-swa-bounded-replay"])
    assert on["enable_decoder_swa_bounded_replay"] is True and on["decoder_replay_set_on_line"]


def test_the_engines_refusal_is_reported_not_raised(engine):
    """An option the engine refuses for V4.1 there (pipeline parallelism) is the engine's text."""
    _, argv = _line()
    resolved = cluster.resolve(argv + ["--pp-size", "2"])
    assert "pipeline parallelism" in resolved["error"]
    verdict = cluster.verdicts(resolved, {"DSV41_SWA_THIN": "1"}, {"swa_thin": True})
    assert verdict["swa_thin"]["acts"] is False and "refuses" in verdict["swa_thin"]["why"]


RESOLVED = {"enable_decoder_swa_bounded_replay": True, "enable_encoder_swa_bounded_replay": False,
            "chunked_prefill_size": 8192, "enable_dp_attention": False, "pp_size": 1,
            "platform": cluster.PLATFORM_TEXT, "decoder_replay_set_on_line": False}
ALL = {"swan": True, "decode_yield": True, "swa_thin": True, "swa_cone": True,
       "autotune_keep": True, "input_guard": True, "admin_guard": True}


def test_every_production_adapter_acts_beside_the_decoder_replay():
    keys, _ = _line()
    verdict = cluster.verdicts(RESOLVED, keys, ALL)
    assert set(verdict) == set(ALL) and all(v["acts"] for v in verdict.values()), verdict


@pytest.mark.parametrize("change,env,adapter,why", [
    ({"enable_encoder_swa_bounded_replay": True}, {}, "swa_cone", "encoder"),
    ({"enable_encoder_swa_bounded_replay": True}, {}, "swa_thin", "no SWA window"),
    ({"chunked_prefill_size": 4096}, {}, "swa_cone", "no first pass covers the replay"),
    ({"enable_dp_attention": True}, {}, "decode_yield", "DP attention"),
    ({"pp_size": 2}, {}, "decode_yield", "pipeline parallelism"),
    ({}, {"SGLANG_SM120_FLASHMLA_BACKEND": "torch"}, "swan", "does not split pages"),
])
def test_an_adapter_that_cannot_act_there_is_said_to_decline(change, env, adapter, why):
    keys, _ = _line()
    verdict = cluster.verdicts({**RESOLVED, **change}, {**keys, **env}, ALL)
    assert verdict[adapter]["acts"] is False and why in verdict[adapter]["why"], verdict[adapter]
    assert verdict["autotune_keep"]["acts"] and verdict["input_guard"]["acts"]


def test_the_text_names_the_resolution_and_each_verdict():
    keys, _ = _line()
    text = "\n".join(cluster.format_lines(RESOLVED, cluster.verdicts(
        {**RESOLVED, "chunked_prefill_size": 4096}, keys, ALL)))
    assert "decoder SWA bounded replay on (the engine's default)" in text
    assert "swa_cone       DECLINES: DSV41_SWA_CONE_TOKENS=8192 exceeds --chunked-prefill-size 4096" in text
