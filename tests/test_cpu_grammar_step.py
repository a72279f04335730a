"""The CPU harness's planted slow grammar step (adapter/cpu/grammar_step.py, tests only): each
xgrammar GrammarMatcher.accept_token sleeps the planted time first, and the input guard's timing of
the engine's XGrammarGrammar.accept_token sees at least that time (tests/e2e/test_e2e_tp2.py
relies on it for its grammar step bound on any machine)."""
import pytest

from adapter.cpu import grammar_step


def _matcher():
    import xgrammar as xg

    info = xg.TokenizerInfo(["a", "b", "c", "<eos>"], stop_token_ids=[3])
    return xg.GrammarMatcher(xg.GrammarCompiler(info).compile_regex("(a|b)+c"))


def test_each_accept_token_sleeps_the_planted_time_then_runs_the_real_one(monkeypatch, capsys):
    import xgrammar.matcher as module

    monkeypatch.setattr(module.GrammarMatcher, "accept_token", module.GrammarMatcher.accept_token)
    monkeypatch.setenv(grammar_step.ENV, "12.5")
    slept = []
    grammar_step.apply(module, sleep=slept.append)
    grammar_step.apply(module, sleep=slept.append)      # idempotent: one wrap, not two
    m = _matcher()
    assert [m.accept_token(t) for t in (0, 2, 1)] == [True, True, False]   # the real matcher's
    assert slept == [pytest.approx(0.0125)] * 3
    assert capsys.readouterr().err.count("planted grammar step armed") == 1


def test_the_guard_times_the_planted_step(install_adapters, monkeypatch):
    """The planted cost sits below the engine's XGrammarGrammar.accept_token, which the installed
    guard wraps and times (its pin stays the stock one: the guard installs): a planted 30 ms sleep
    per call is at least 30 ms on the guard's clock (a sleep lasts at least its time: a lower
    bound on any machine, fast or loaded)."""
    import xgrammar.matcher as module

    monkeypatch.setattr(module.GrammarMatcher, "accept_token", module.GrammarMatcher.accept_token)
    monkeypatch.setenv(grammar_step.ENV, "30")
    grammar_step.apply(module)
    status = install_adapters({"DSV41_INPUT_GUARD": "1"})
    assert status["input_guard"].status == "installed", status["input_guard"]
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar

    grammar = XGrammarGrammar(_matcher(), 4, None, None)
    grammar.accept_token(0)                          # the guard's wrap: times the engine's call
    assert grammar.accepted_tokens == [0] and grammar._dsv41_step_us >= 30_000


@pytest.mark.parametrize("raw", ["abc", "0", "-5", "nan", "inf", ""])
def test_a_bad_planted_step_is_refused(monkeypatch, raw):
    monkeypatch.setenv(grammar_step.ENV, raw)
    with pytest.raises(ValueError, match="DSV41CPU_GRAMMAR_STEP_MS"):
        grammar_step.step_ms()
