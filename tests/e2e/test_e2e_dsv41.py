"""A whole tiny DeepSeek-V4.1 in the real server on CPU (CpuServer(model="dsv41"),
adapter/cpu/models.py: `model_type` deepseek_v41 through the engine's DeepseekV41Config, compress
ratios 0 / 2 / 1 / 1, kv- and index-source layers 1 and 2, candidate source 2), with the engine's
V4.1 default on CUDA that CPU does not resolve set by the harness on both lines:
`--enable-decoder-swa-bounded-replay` (adapter/cpu/server.py MODEL_HARNESS_ARGS).

The session's boots (tests/e2e/e2e_configs.py), one each: the control line (autotune_keep alone)
and the production line of .env.tp4.example, each serving the canary's equality set (a short
prompt, a 1,280-token prompt in 512-token chunks, its repeat: a radix hit, a resume, four prompts
in one batch; then the lost-window resume of the dsv4 canary, traffic.dsv4_window_resume). Asserted: both boot; greedy T=0 ids equal (logprobs within traffic.LOGPROB_TOL)
on every prompt; the repeat and the resume hit the cache; the engine resolved the decoder
bounded replay on (its /server_info); every enabled adapter's install receipt in the scheduler;
the V4.1 stand-ins' receipts and their first calls. Printed: swan's served decode calls and
cone's fallback lines."""
import pytest

from adapter.cpu import server as cpu_server
from adapter.tools import canary, traffic

# The session's shared runs this module reads (booted by conftest's lane ahead of it).
SHARED_BOOTS = [("dsv41", "autotune_keep"), ("dsv41", "production")]

LOG_LINES = ("Initialize DeepSeekV4TokenToKVPool", "Using DeepseekV4AttnBackend",
             "Init Unified Radix Cache. Components: (<ComponentType.FULL: 0>, <ComponentType.SWA: 1>)",
             # the V4.1 stand-ins: bound where the engine binds them, and reached by the traffic
             "[dsv41-cpu] dsv41 stand-ins in sglang.kernels.ops.kvcache.dsv4_fp4_index_k_cache: "
             "gather_fp4_index_k, store_fp4_index_k_cache",
             "[dsv41-cpu] dsv41 stand-ins in sglang.kernels.ops.attention.dsv4.attn: fused_store_cache",
             "[dsv41-cpu] dsv41 stand-ins in sglang.kernels.ops.attention.dsv4.fp4_indexer: "
             "fp4_index_logits_decode",
             "[dsv41-cpu] dsv41 stand-in called: store_fp4_index_k_cache",
             "[dsv41-cpu] dsv41 stand-in called: fused_store_cache/flashmla",
             "[dsv41-cpu] dsv41 stand-in called: fp4_index_logits_decode")


@pytest.fixture(scope="module")
def runs(boots):
    return {"control": boots.config("dsv41", "autotune_keep"),
            "production": boots.config("dsv41", "production")}


@pytest.fixture(scope="module")
def report(runs):
    return canary.model_report("dsv41", runs["control"], runs["production"])


def test_both_lines_boot_and_serve(runs):
    for label, run in runs.items():
        assert not run.errors, (label, run.errors)
        assert run.records and run.boot_s > 0, label
        print(f"\ndsv41 {label}: boot {run.boot_s:.1f} s, {len(run.records)} requests")


def test_harness_sets_the_engines_cuda_default_and_the_engine_resolves_it_on(runs):
    flag = cpu_server.BOUNDED_REPLAY_FLAG
    for label, run in runs.items():
        assert run.harness_args.get(flag) == "on", (label, run.harness_args)
        assert flag not in run.args                          # not the line's: the harness's
        assert "the engine's V4.1 default on CUDA" in canary.harness_arg_why("dsv41", flag)
        info = run.extras["server_info"]
        print(f"\ndsv41 {label} resolved: {info}")
        assert info["enable_decoder_swa_bounded_replay"] is True, info
        assert info["enable_encoder_swa_bounded_replay"] is False       # CUDA / gfx950 only
        assert info["dsv4_attn_backend"] == "flashmla"      # GB10 too: flashmla_mega needs SM100
        log = "\n".join(run.lines("sglang::scheduler"))
        # set explicitly, the engine logs no resolution of its default
        assert "decoder SWA bounded replay resolved to" not in "\n".join(run.logs.values())
        missing = [line for line in LOG_LINES if line not in log]
        assert not missing, (label, missing)


def test_greedy_outputs_equal_control_vs_production(runs):
    """The canary's comparison (canary.compare_runs): every record's T=0 ids equal and logprobs
    within the model's tolerance (canary.LOGPROB_TOL: torch's fp32 linear on CPU takes another
    kernel for one row than for several, and decode yield changes the decode batches by design);
    cone's replayed resume against the control's prefix hit at F (the decoder bounded replay makes
    a resume's answer depend on where its passes start: docs/swa_cone.md)."""
    control, line = runs["control"], runs["production"]
    cmp = canary.compare_runs("dsv41", control, line)
    print(f"\ndsv41 T=0: {cmp.equal} of {cmp.total} within {canary.LOGPROB_TOL['dsv41']}, max logprob "
          f"diff {cmp.max_logprob_diff:.3g}; mismatches {cmp.mismatches}")
    assert cmp.total >= 10 and cmp.ok, cmp
    for run in (control, line):
        hits = {r.name: r.cached_tokens for r in canary.records_of(run)}
        print(f"dsv41 cached tokens: {hits}")
        assert hits["cache-hit"] > 0 and hits["resume"] > 0     # the radix cache served hits


def test_every_enabled_adapter_installed_and_what_swan_and_cone_did(report):
    adapters = report["adapters"]
    assert not report["not_installed"], report["not_installed"]
    for name, a in adapters.items():
        if a["enabled"]:
            # in the process that hosts it (the scheduler; admin_guard: the launcher's HTTP app)
            where = canary.install_process(name)
            assert any(v for r, v in a["installed"].items() if r.startswith(where)), (name, a["installed"])
    swan, cone = adapters["swan"], adapters["swa_cone"]
    print(f"\nswan on V4.1 decode: {swan['effect']}")
    print("cone fallbacks: " + " | ".join(cone["fallbacks"]))
    assert swan["effect"]["selfcheck"]["failed"] == 0 and swan["effect"]["served"] > 0
    # issue 48: cone acts beside the engine's decoder SWA bounded replay. The lost-window resume
    # (traffic.dsv41_window_resume) is planned and copied; it reuses what the control re-prefills;
    # and it answers as the control's same prompt served as a prefix hit at F (the engine's own
    # computation with the flag on: traffic.prefix_hit)
    effect = cone["effect"]
    print(f"cone effect: {effect}")
    assert effect["plans"] >= 1 and effect["copies"] >= 1, effect
    assert effect["lost_window_resume_cached_line"] > effect["lost_window_resume_cached_control"]
    assert effect["plan_F"] == [effect["hit_at_F_cached_control"]]     # the reference: a hit at F
    # held to it by the canary's comparison (test_greedy_outputs_equal_control_vs_production):
    # no error names cone's resume
    assert not [e for e in report["errors"] if "swa_cone" in e]
    assert not [f for f in cone["fallbacks"] if "bounded-replay" in f], cone["fallbacks"]
    assert report["errors"] == [], report["errors"]
