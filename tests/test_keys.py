"""The key registry: strict parsing, typos, unknown keys, volatility."""
import os

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
    for name in ("DSV41_SWA_CONE_TEST", "DSV41_SWA_CONE_TEST_NO_FLOOR", "DSV41_SWA_CONE_TEST_NO_COPY",
                 "DSV41_SWA_CONE_TEST_NO_MASK"):
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
    for name in ("DSV41_SWA_CONE_TEST_NO_FLOOR", "DSV41_SWA_CONE_TEST_NO_COPY",
                 "DSV41_SWA_CONE_TEST_NO_MASK"):
        line = next(ln for ln in out.splitlines() if ln.startswith(name + " "))
        assert "test-only" in line, line


# ---- parser edges (each found by bench/mutation.py: a mutant of keys.py these tests kill) ----

@pytest.mark.parametrize("raw, value", [("1", 1), ("on", 1), (" Yes ", 1), ("TRUE", 1),
                                        ("0", 0), ("off", 0), ("No", 0), ("false", 0)])
def test_flag_spellings(raw, value):
    assert keys.parse_env({"DSV41_SWA_THIN": raw}).get("DSV41_SWA_THIN") == value


@pytest.mark.parametrize("raw, ok", [("1", True), ("99", True), ("10", True), (" 33 ", True),
                                     ("0", False), ("100", False), ("0x10", False)])
def test_int_range_is_inclusive_and_decimal(raw, ok):
    env = {"DSV41_DECODE_YIELD": raw}
    if ok:
        assert keys.parse_env(env).get("DSV41_DECODE_YIELD") == int(raw)
    else:
        with pytest.raises(keys.ConfigError, match="DSV41_DECODE_YIELD"):
            keys.parse_env(env)


def test_int_with_only_an_upper_bound_and_multiple():
    assert keys.parse_env({"DSV41_SWA_CONE_TOKENS": "256"}).get("DSV41_SWA_CONE_TOKENS") == 256
    assert keys.parse_env({"DSV41_SWA_CONE_TOKENS": "65536"}).get("DSV41_SWA_CONE_TOKENS") == 65536
    with pytest.raises(keys.ConfigError, match=r"DSV41_SWA_CONE_TOKENS=65792: out of range 256\.\.65536"):
        keys.parse_env({"DSV41_SWA_CONE_TOKENS": "65792"})


MODEL = "DSV41_DECODE_YIELD_MODEL"
FIELDS = "CHUNK_FIXED_US,CHUNK_TOKEN_NS,CHUNK_PAIR_PS,STEP_FIXED_US,STEP_ROW_US,STEP_CTX_PS,CHUNK_PREFIX_SQ_PS"


def test_ints_key_parses_each_field_in_order():
    s = keys.parse_env({MODEL: " 0, 10 ,1000000000,1, 60000000,52000"})
    assert s.get(MODEL) == (0, 10, 1_000_000_000, 1, 60_000_000, 52_000, 0)   # six: the seventh is 0
    assert s.set_keys == (MODEL,)


@pytest.mark.parametrize("raw, message", [
    ("1,2,3,4,5", f"{MODEL}='1,2,3,4,5': expected 6 or 7 comma-separated integers {FIELDS} ("),
    ("1 2 3 4 5 6", f"{MODEL}='1 2 3 4 5 6': expected 6 or 7 comma-separated integers {FIELDS} ("),
    ("1,2,3,x,5,6", f"{MODEL}='1,2,3,x,5,6': STEP_FIXED_US='x' is not an integer (expected {FIELDS})"),
    ("1,2,3,0,5,6", f"{MODEL}='1,2,3,0,5,6': STEP_FIXED_US=0 out of range 1..60000000"),
    ("1,2,3,4,5,1000000001",
     f"{MODEL}='1,2,3,4,5,1000000001': STEP_CTX_PS=1000000001 out of range 0..1000000000"),
    ("-1,2,3,4,5,6", f"{MODEL}='-1,2,3,4,5,6': CHUNK_FIXED_US=-1 out of range 0..60000000"),
])
def test_ints_key_errors_name_the_field(raw, message):
    with pytest.raises(keys.ConfigError) as info:
        keys.parse_env({MODEL: raw})
    assert str(info.value).startswith(message), str(info.value)


def test_ints_key_takes_all_its_fields_and_no_more():
    s = keys.parse_env({MODEL: "1,2,3,4,5,6,7"})                # all seven: the squared-prefix term
    assert s.get(MODEL) == (1, 2, 3, 4, 5, 6, 7)
    with pytest.raises(keys.ConfigError, match=r"expected 6 or 7 comma-separated integers"):
        keys.parse_env({MODEL: "1,2,3,4,5,6,7,8"})


def test_an_ints_key_without_optional_fields_names_one_count():
    """A key whose every field is required (no min_fields) names that one count."""
    key = keys.Key("DSV41_X", "ints", "decode_yield", doc="two", fields=(("A", 0, 9), ("B", 0, 9)))
    assert keys._parse_ints(key, "3, 4") == (3, 4)
    for raw in ("3", "3,4,5"):
        with pytest.raises(keys.ConfigError) as info:
            keys._parse_ints(key, raw)
        assert str(info.value) == f"DSV41_X={raw!r}: expected 2 comma-separated integers A,B (two)"


def test_test_only_keys_are_those_set_and_marked_test_only():
    env = {"DSV41_ADMIN_GUARD_TEST": "1", "DSV41_SWA_CONE_TEST": "1", "DSV41_SWA_THIN": "1"}
    assert [k.name for k in keys.test_only_keys(env)] == ["DSV41_SWA_CONE_TEST", "DSV41_ADMIN_GUARD_TEST"]
    assert keys.test_only_keys({"DSV41_SWA_THIN": "1"}) == []
    marked = {k.name for k in keys.KEYS if k.test_only}
    assert {k.name for k in keys.test_only_keys({name: "1" for name in marked})} == marked


def test_two_bad_keys_are_both_reported():
    with pytest.raises(keys.ConfigError) as info:
        keys.parse_env({"DSV41_SWA_THIN": "2", "DSV41_DECODE_YIELD": "0"})
    assert str(info.value) == ("DSV41_DECODE_YIELD=0: out of range 1..99 ("
                               + keys.KEY_BY_NAME["DSV41_DECODE_YIELD"].doc + "); "
                               "DSV41_SWA_THIN='2': expected 0 or 1 ("
                               + keys.KEY_BY_NAME["DSV41_SWA_THIN"].doc + ")")


def test_typo_distance_two_is_an_error_three_is_only_reported():
    with pytest.raises(keys.ConfigError, match="did you mean DSV41_SWA_THIN"):
        keys.parse_env({"DSV41_SWA_TXXN": "1"})          # distance 2
    s = keys.parse_env({"DSV41_SWA_XXXN": "1"})           # distance 3
    assert s.unknown == ("DSV41_SWA_XXXN",) and not s.enabled("swa_thin")


def test_set_keys_names_what_the_environment_set(monkeypatch):
    for name in [n for n in os.environ if n.startswith("DSV41_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("DSV41_SWA_THIN", "1")
    monkeypatch.setenv("DSV41_SWA_CONE_TOKENS", "512")
    s = keys.parse_env()                                  # reads os.environ
    assert s.set_keys == ("DSV41_SWA_THIN", "DSV41_SWA_CONE_TOKENS")
    assert s.get("DSV41_SWA_CONE_TOKENS") == 512 and s.enabled("swa_thin")
    assert s.keys_of("swa_thin") == {"DSV41_SWA_THIN": 1}
    assert s.keys_of("decode_yield") == {"DSV41_DECODE_YIELD": None, MODEL: None,
                                         "DSV41_DECODE_YIELD_ONLINE": 0}


@pytest.mark.parametrize("a, b, d", [("", "abc", 3), ("abc", "abd", 1), ("abc", "ab", 1),
                                     ("ab", "abc", 1), ("ab", "ba", 2), ("kitten", "sitting", 3),
                                     ("flaw", "lawn", 2), ("", "", 0)])
def test_edit_distance_is_levenshtein(a, b, d):
    assert keys.edit_distance(a, b) == d


def test_keys_text_shows_type_range_default_volatility_in_aligned_columns():
    """`dsv41 keys`: one row per key whose columns line up however long the name (issue 51)."""
    from adapter.tools import cli

    text = cli.format_keys(keys.KEYS)
    lines = text.splitlines()
    head = lines[0]
    assert head.split() == ["key", "adapter", "type", "range", "default", "volatility", "role"]
    starts = [head.index(c) for c in ("adapter", "type", "range", "default", "volatility", "role")]
    rows = {ln.split()[0]: ln for ln in lines[1:] if ln.startswith("DSV41_")}
    assert set(rows) == {k.name for k in keys.KEYS}
    for name, row in rows.items():
        for at in starts:                       # every column starts where its heading does
            assert row[at - 2:at] == "  " and row[at] != " ", (name, at, row)
    longest = max(keys.KEYS, key=lambda k: len(k.name)).name
    assert rows[longest].split()[1] == keys.KEY_BY_NAME[longest].adapter
    assert rows["DSV41_SWAN_SELFCHECK"].split()[1:7] == ["swan", "int", "0..2", "1", "volatile", "setting"]
    assert rows["DSV41_DECODE_YIELD"].split()[3:5] == ["1..99", "unset"]
    assert "256..65536 step 256" in rows["DSV41_SWA_CONE_TOKENS"]
    assert rows["DSV41_SWA_CONE_REPLAY"].rstrip().endswith("on switch")
    assert rows["DSV41_ADMIN_GUARD_TEST"].rstrip().endswith("test-only")


def test_swan_selfcheck_is_a_registered_key_on_by_default():
    key = keys.KEY_BY_NAME["DSV41_SWAN_SELFCHECK"]
    assert key.adapter == "swan" and key.default == 1 and not key.test_only and not key.enables
    assert keys.parse_env({}).get("DSV41_SWAN_SELFCHECK") == 1
