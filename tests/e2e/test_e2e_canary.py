"""`dsv41 canary --profile .env.tp4.example --json` on both models (boots shared with the other
e2e tests through `boots.run`)."""
import argparse
import json

from adapter.table import ADAPTERS
from e2e.e2e_configs import PROFILE


def test_canary_production_against_control_exits_0_with_the_figures(boots, capsys):
    from adapter.tools import canary

    args = argparse.Namespace(profile=str(PROFILE), line="production", against="control",
                              model="both", json=True, nodes=1)
    code = canary.main(args, run=boots.run)
    out = capsys.readouterr().out
    report = json.loads(out)
    assert code == 0, out[-4000:]
    assert report["ok"] is True
    assert {"profile", "line", "against", "ignored", "models", "elapsed_s"} <= set(report)
    assert "--tp-size 4" in report["ignored"] and "NCCL_IB_HCA" in report["ignored"]
    for model in ("dense", "swa"):
        m = report["models"][model]
        assert m["ok"] and not m["errors"] and not m["not_installed"]
        assert m["equality"]["equal"] == m["equality"]["total"] > 0
        for name in ADAPTERS:
            a = m["adapters"][name]
            assert a["enabled"] and a["installed"][canary.install_process(name)], (model, name, a)
            assert set(a) >= {"installed", "receipts", "fallbacks", "equality", "effect"}
    dense, swa = report["models"]["dense"]["adapters"], report["models"]["swa"]["adapters"]
    # decode yield acted (its receipt lines); the cadences are reported, not ordered: time
    # ratios across boots of a 2-core machine belong to benchmarks, not to a test
    assert dense["decode_yield"]["effect"]["yield_lines"] > 0
    assert dense["decode_yield"]["effect"]["long_prompt_completed"]
    assert swa["swa_thin"]["effect"]["idle_resume_cached_line"] > swa["swa_thin"]["effect"]["idle_resume_cached_control"]
    assert swa["swa_cone"]["effect"]["plans"] == 0 and swa["swa_cone"]["fallbacks"]


def test_canary_bad_profile_line_is_a_clear_error(capsys):
    from adapter.tools import canary

    args = argparse.Namespace(profile=str(PROFILE), line="nosuchline", against="control",
                              model="dense", json=False)
    assert canary.main(args) == 2
    assert "no line 'nosuchline'" in capsys.readouterr().err
