"""The key registry: strict parsing, typos, unknown keys, volatility."""
import pytest

from adapter import keys
from adapter.table import ADAPTERS


def test_all_keys_unset_means_every_adapter_off():
    settings = keys.parse_env({})
    assert not any(settings.enabled(a) for a in ADAPTERS)
    assert settings.get("DSV41_SWA_CONE_TOKENS") == 8192


def test_production_values_parse():
    s = keys.parse_env({"DSV41_DECODE_YIELD": "33", "DSV41_SWA_THIN": "1",
                        "DSV41_SWA_CONE_REPLAY": "1", "DSV41_SWA_CONE_TOKENS": "8192"})
    assert s.get("DSV41_DECODE_YIELD") == 33
    assert s.enabled("decode_yield") and s.enabled("swa_thin") and s.enabled("swa_cone")
    assert not s.enabled("swan")


@pytest.mark.parametrize("env, needle", [
    ({"DSV41_DECODE_YIELD": "abc"}, "DSV41_DECODE_YIELD='abc': expected an integer"),
    ({"DSV41_DECODE_YIELD": "150"}, "DSV41_DECODE_YIELD=150: out of range 1..99"),
    ({"DSV41_DECODE_YIELD": "0"}, "out of range 1..99"),
    ({"DSV41_DECODE_YIELD": ""}, "expected an integer"),
    ({"DSV41_SWA_THIN": "2"}, "DSV41_SWA_THIN='2': expected 0 or 1"),
    ({"DSV41_SWA_CONE_TOKENS": "8000"}, "must be a multiple of 256"),
    ({"DSV41_DECODE_YEILD": "33"}, "did you mean DSV41_DECODE_YIELD"),
    ({"DSV41_SWA_THN": "1"}, "did you mean DSV41_SWA_THIN"),
])
def test_bad_input_is_an_error_naming_the_key(env, needle):
    with pytest.raises(keys.ConfigError, match=None) as info:
        keys.parse_env(env)
    assert needle in str(info.value)


def test_far_unknown_key_is_only_reported():
    s = keys.parse_env({"DSV41_OPERATOR_OWN_THING": "1"})
    assert s.unknown == ("DSV41_OPERATOR_OWN_THING",)


def test_every_v264_key_is_volatile_and_launch_args_are_not_keys():
    vol = keys.volatile_keys()
    for name in ("DSV41_SWA_NATIVE_DECODE", "DSV41_DECODE_YIELD", "DSV41_SWA_THIN",
                 "DSV41_SWA_CONE_REPLAY", "DSV41_SWA_CONE_TOKENS", "SGLANG_RUN_ID"):
        assert name in vol
    assert not any(v.startswith("--") for v in vol)


def test_every_key_belongs_to_an_adapter_of_the_table():
    assert {k.adapter for k in keys.KEYS} == set(ADAPTERS)
    assert all(any(k.enables for k in keys.KEYS if k.adapter == a) for a in ADAPTERS)


def test_edit_distance():
    assert keys.edit_distance("DSV41_SWA_THIN", "DSV41_SWA_THIN") == 0
    assert keys.edit_distance("DSV41_SWA_THN", "DSV41_SWA_THIN") == 1
    assert keys.edit_distance("abc", "") == 3


def test_cone_test_switches_are_test_only_and_listed_so():
    """Test-only switches: in no profile (tests/test_profile.py), never enabling, default off;
    `dsv41 keys` marks them test-only."""
    for name in ("DSV41_SWA_CONE_TEST", "DSV41_SWA_CONE_TEST_NO_FLOOR", "DSV41_SWA_CONE_TEST_NO_COPY"):
        key = keys.KEY_BY_NAME[name]
        assert key.test_only and not key.enables and key.default == 0 and key.adapter == "swa_cone"
    s = keys.parse_env({"DSV41_SWA_CONE_REPLAY": "1", "DSV41_SWA_CONE_TEST_NO_FLOOR": "1"})
    assert s.get("DSV41_SWA_CONE_TEST_NO_FLOOR") == 1 and s.enabled("swa_cone")
    assert not keys.parse_env({"DSV41_SWA_CONE_TEST_NO_FLOOR": "1"}).enabled("swa_cone")
    with pytest.raises(keys.ConfigError, match="DSV41_SWA_CONE_TEST_NO_FLOOR='2': expected 0 or 1"):
        keys.parse_env({"DSV41_SWA_CONE_TEST_NO_FLOOR": "2"})


def test_dsv41_keys_lists_the_cone_negative_controls_as_test_only(capsys):
    from adapter.tools import cli

    assert cli.main(["keys"]) == 0
    out = capsys.readouterr().out
    for name in ("DSV41_SWA_CONE_TEST_NO_FLOOR", "DSV41_SWA_CONE_TEST_NO_COPY"):
        line = next(ln for ln in out.splitlines() if ln.startswith(name + " "))
        assert "test-only" in line, line
