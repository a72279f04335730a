"""`dsv41 canary --profile .env.tp4.example --json` on its default models, dense and the tiny
DeepSeek-V4.1 (boots shared with the other e2e tests through `boots.run`)."""
import argparse
import json

from adapter.table import ADAPTERS
from e2e.e2e_configs import PROFILE

# The session's shared runs this module reads (booted by conftest's lane ahead of it).
SHARED_BOOTS = [("dense", "autotune_keep"), ("dense", "production"), ("dsv41", "autotune_keep"), ("dsv41", "production")]


def cli_default_models():
    from adapter.tools import cli

    parser = cli.build_parser()
    return parser.parse_args(["canary", "--profile", str(PROFILE)]).model


def test_canary_production_against_control_exits_0_with_the_figures(boots, capsys):
    from adapter.tools import canary

    args = argparse.Namespace(profile=str(PROFILE), line="production", against="control",
                              model=cli_default_models(), json=True, nodes=1)
    code = canary.main(args, run=boots.run)
    out = capsys.readouterr().out
    report = json.loads(out)
    assert code == 0, out[-4000:]
    assert report["ok"] is True
    assert {"profile", "line", "against", "ignored", "models", "elapsed_s"} <= set(report)
    assert "--tp-size 4" in report["ignored"] and "NCCL_IB_HCA" in report["ignored"]
    assert list(report["models"]) == ["dense", "dsv41"]
    for model in ("dense", "dsv41"):
        m = report["models"][model]
        assert m["ok"] and not m["errors"] and not m["not_installed"]
        assert m["equality"]["equal"] == m["equality"]["total"] > 0
        for name in ADAPTERS:
            a = m["adapters"][name]
            assert a["enabled"] and a["installed"][canary.install_process(name)], (model, name, a)
            assert set(a) >= {"installed", "receipts", "fallbacks", "equality", "effect"}
    dense, dsv4 = report["models"]["dense"]["adapters"], report["models"]["dsv41"]["adapters"]
    # decode yield acted (its receipt lines); the cadences are reported, not ordered: time
    # ratios across boots of a 2-core machine belong to benchmarks, not to a test
    assert dense["decode_yield"]["effect"]["yield_lines"] > 0
    assert dense["decode_yield"]["effect"]["long_prompt_completed"]
    # DeepSeek-V4.1, the engine's decoder SWA bounded replay on in both boots: swan served decode
    # calls in place (CPU twin), cone replayed a lost window (held to the control's prefix hit at
    # F), thin kept the idle session, decode yield decided during the chunked prefill
    replay = report["models"]["dsv41"]["bounded_replay"]
    assert all(r["enable_decoder_swa_bounded_replay"] for r in replay.values()) and len(replay) == 2
    assert report["scaled"] and any(k.startswith("DSV41_SWA_CONE_TOKENS") for k in report["scaled"])
    assert dsv4["swan"]["effect"]["served"] > 0 and dsv4["swan"]["effect"]["kernel"] == "CPU twin"
    assert dsv4["swan"]["effect"]["selfcheck"]["verified"] > 0
    assert dsv4["swan"]["effect"]["selfcheck"]["failed"] == 0
    cone = dsv4["swa_cone"]["effect"]
    assert cone["plans"] > 0 and cone["copies"] > 0
    assert cone["lost_window_resume_cached_line"] > cone["lost_window_resume_cached_control"]
    assert cone["plan_F"] == [cone["hit_at_F_cached_control"]]
    thin = dsv4["swa_thin"]["effect"]
    assert thin["idle_resume_cached_line"] > thin["idle_resume_cached_control"]
    assert dsv4["decode_yield"]["effect"]["decision_lines"] > 0


def test_canary_bad_profile_line_is_a_clear_error(capsys):
    from adapter.tools import canary

    args = argparse.Namespace(profile=str(PROFILE), line="nosuchline", against="control",
                              model="dense", json=False)
    assert canary.main(args) == 2
    assert "no line 'nosuchline'" in capsys.readouterr().err
