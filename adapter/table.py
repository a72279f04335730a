"""THE table: which engine callable each adapter wraps, and which keys turn it on.

One row per wrapped callable: (adapter, engine module, qualname). Rows of one callable are
applied in table order, the first row innermost: an adapter further down the table wraps the
result of the ones above it. Adapters that share a callable are installed together in one pass,
so that order holds whichever engine module a process imports first.
The keys of each adapter live in adapter/keys.py (the key registry).

Each row also declares what its hook *touches*: every engine (or FlashInfer) internal it reads or
calls without wrapping it, as "module:qualname" ("module:Class.attr" for an attribute the class
sets on its instances). adapter/pins.json pins them beside the wrapped callables, and drift in one
refuses the adapter at boot exactly as drift in a wrapped callable does (adapter/pins.py).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Hook:
    adapter: str      # adapter name == module adapter/<name>.py
    module: str       # engine module that defines the callable
    qualname: str     # "Class.method" or "function"
    touches: tuple[str, ...] = ()   # engine internals the hook reads or calls ("module:qualname")

    @property
    def target(self) -> str:
        """Dotted path in HookRegistry's form."""
        return f"{self.module}.{self.qualname}"

    @property
    def pin_id(self) -> str:
        return f"{self.module}:{self.qualname}"


_SCHED = "sglang.srt.managers.scheduler"
_POLICY = "sglang.srt.managers.schedule_policy"
_URC = "sglang.srt.mem_cache.unified_radix_cache"
_TREE_CORES = "sglang.srt.mem_cache.unified_cache.tree_core_registry"
_SM120 = "sglang.kernels.ops.attention.flash_mla_sm120"
_AUTOTUNE = "sglang.srt.model_executor.runner.flashinfer_autotune"

_SB = "sglang.srt.managers.schedule_batch"
_UTC = "sglang.srt.mem_cache.unified_cache.unified_tree_core"
_DSV4 = "sglang.srt.layers.attention.deepseek_v4_backend"
_FB = "sglang.srt.model_executor.forward_batch_info"
_RC = "sglang.srt.runtime_context"
_FI_SM120 = "flashinfer.mla._sparse_mla_sm120"
_UTCI = "sglang.srt.mem_cache.unified_cache.unified_tree_core_interface"
_COMP = "sglang.srt.mem_cache.unified_cache.components"
_SWA = "sglang.srt.mem_cache.unified_cache.components.swa"
_RADIX = "sglang.srt.mem_cache.radix_cache"
_TM = "sglang.srt.managers.tokenizer_manager"
_IO = "sglang.srt.managers.io_struct"
_HTTP = "sglang.srt.entrypoints.http_server"
_AUTH = "sglang.srt.utils.auth"
_SERVING = "sglang.srt.arg_groups.fields.serving"
_PS = "sglang.srt.distributed.parallel_state"
_SP = "sglang.srt.sampling.sampling_params"
_XG = "sglang.srt.constrained.xgrammar_backend"
_OLLAMA = "sglang.srt.entrypoints.ollama.serving"
_OAI = "sglang.srt.entrypoints.openai"

HOOKS: tuple[Hook, ...] = (
    # swan: SM12x sparse decode reads 256-token SWA pages in place (the SM12x decode entry;
    # calls it cannot serve go to the stock function, which keeps _split_kv_pages_to_64).
    Hook("swan", _SM120, "flash_mla_with_kvcache_sm120", touches=(
        f"{_FI_SM120}._prepared:resolve_execution", f"{_FI_SM120}._prepared:device_caps",
        f"{_FI_SM120}._calibration:refresh_store", f"{_FI_SM120}._execution:AttentionMetadata",
        f"{_SM120}:_split_kv_pages_to_64",
        # the router reads the engine's backend; the CPU twin (adapter/swan/twin.py) calls its
        # torch sparse decode
        f"{_SM120}:_sm120_default_backend", f"{_SM120}:_sm120_sparse_decode_fwd",
        # the self-check agrees each new key's verdict over the attention TP group's gloo group
        f"{_RC}:get_parallel", f"{_RC}:ParallelContext.attn_tp_group", f"{_PS}:GroupCoordinator.cpu_group",
        f"{_PS}:GroupCoordinator.world_size", f"{_PS}:GroupCoordinator.rank_in_group")),
    # decode yield: defer the next chunk of a chunked prefill through the engine's own path.
    Hook("decode_yield", _SCHED, "Scheduler.get_next_batch_to_run", touches=(
        f"{_SB}:NextBatchPlan.batch_to_run", f"{_SB}:NextBatchPlan.running_batch",
        f"{_SB}:ScheduleBatch.reqs", f"{_SB}:ScheduleBatch.decoding_reqs",
        f"{_SB}:Req.seqlen", f"{_SB}:Req.rid",
        f"{_SCHED}:Scheduler.chunked_req", f"{_SCHED}:Scheduler.prefill_decode_interval",
        f"{_SCHED}:Scheduler.prefill_decode_interval_min_bs",
        # the achieved-share measurement (logs and /metrics only): the engine's step timings
        f"{_SCHED}:Scheduler._record_step_counters", f"{_SCHED}:Scheduler.total_prefill_busy_us",
        f"{_SCHED}:Scheduler.decode_moment_totals", f"{_SCHED}:_accumulate_decode_moment",
        # DSV41_DECODE_YIELD_ONLINE: the same timings scale the model, agreed over the attention
        # TP group's gloo group (adapter/tp_group.py)
        f"{_RC}:ParallelContext.attn_tp_group", f"{_PS}:GroupCoordinator.cpu_group",
        f"{_PS}:GroupCoordinator.world_size", f"{_PS}:GroupCoordinator.rank_in_group")),
    Hook("decode_yield", _SCHED, "Scheduler._should_defer_prefill", touches=(
        f"{_SB}:ScheduleBatch.batch_size",)),
    Hook("decode_yield", _SCHED, "Scheduler._arm_prefill_decode_interval", touches=(
        f"{_SB}:ScheduleBatch.forward_mode", f"{_SB}:ScheduleBatch.extend_lens",
        f"{_SB}:ScheduleBatch.prefix_lens", f"{_FB}:ForwardMode.is_extend",
        f"{_FB}:ForwardMode.is_decode",       # DSV41_DECODE_YIELD_ONLINE: each batch's modelled cost
        f"{_SCHED}:Scheduler.require_mlp_sync", f"{_SCHED}:Scheduler.dllm_config",
        f"{_RC}:get_parallel")),
    # swa_thin (before swa_cone): moved-past checkpoints to the SWA LRU's evict-first end; with
    # the key set the engine's backend selection picks thin's own tree core for FULL+SWA caches
    # (adapter/swa_thin/core.py, a subclass of the engine's Python core), Python for other SWA
    # stacks (Rust has no LRU API).
    Hook("swa_thin", _URC, "UnifiedRadixCache.checkpoint_into_tree", touches=(
        f"{_UTC}:UnifiedLRUList.__init__",          # sets _pt, head, tail, mid, cache, _is_referenced
        f"{_UTC}:UnifiedLRUList.remove_node", f"{_UTC}:UnifiedLRUList.insert_after",
        f"{_UTC}:UnifiedLRUList.insert_mru",
        f"{_UTC}:UnifiedLRUList._add_node_after",   # puts a node back after a failed move
        f"{_UTC}:UnifiedTreeNode.__init__",         # sets lru_prev, component_data, key, parent, id
        f"{_UTC}:UnifiedTreeCore.node_by_id", f"{_UTC}:UnifiedTreeCore.is_root",
        f"{_UTC}:UnifiedTreeCore.lru_lists", f"{_UTC}:UnifiedTreeCore.root_node",
        f"{_UTC}:UnifiedTreeCore.page_size", f"{_UTC}:UnifiedTreeCore._node_arena",
        f"{_UTC}:UnifiedTreeCore.get_component_device_value",
        f"{_UTCI}:UnifiedTreeCoreInterface.collect_path_info", f"{_UTCI}:TreePathNodeInfo",
        f"{_URC}:UnifiedRadixCache.tree_core", f"{_URC}:UnifiedRadixCache.components",
        f"{_URC}:UnifiedRadixCache.is_swa_enabled", f"{_URC}:UnifiedRadixCache.disable",
        f"{_SWA}:SWAComponent.sliding_window_size",
        f"{_COMP}.base:ComponentType",
        f"{_SB}:Req.lock", f"{_SB}:Req.last_node")),
    Hook("swa_thin", _TREE_CORES, "select_tree_core_backend", touches=(
        f"{_COMP}.base:ComponentType",
        f"{_TREE_CORES}:register_tree_core_backend", f"{_TREE_CORES}:get_tree_core_factory",
        f"{_TREE_CORES}:resolve_tree_core_backend", f"{_TREE_CORES}:create_tree_core",
        f"{_URC}:UnifiedRadixCache.__init__",       # builds its core through create_tree_core
        "sglang.srt.mem_cache.rust_tree_core.adapter:RustUnifiedTreeCore",
        # thin's core (adapter/swa_thin/core.py): the engine methods it overrides ...
        f"{_UTC}:UnifiedTreeCore.__init__", f"{_UTC}:UnifiedTreeCore.reset",
        f"{_UTC}:UnifiedTreeCore._insert_walk_step", f"{_UTC}:UnifiedTreeCore._finish_insert_walk_node",
        f"{_UTC}:UnifiedTreeCore._insert_commit_step", f"{_UTC}:UnifiedTreeCore._touch_node",
        f"{_UTC}:UnifiedTreeCore._match_prefix_helper", f"{_UTC}:UnifiedTreeCore.inc_lock_ref",
        f"{_UTC}:UnifiedTreeCore._release_components",
        f"{_UTC}:UnifiedTreeCore._update_evictable_leaf_sets",
        # ... the engine code whose behaviour its rewrites repeat (drift here changes the answer)
        f"{_UTC}:UnifiedTreeCore.begin_insert", f"{_UTC}:UnifiedTreeCore._advance_insert",
        f"{_UTC}:UnifiedTreeCore._insert_overlap_step", f"{_UTC}:UnifiedTreeCore._insert_tail_step",
        f"{_UTC}:UnifiedTreeCore.match_prefix", f"{_UTC}:UnifiedTreeCore.dec_lock_ref",
        f"{_UTC}:UnifiedTreeCore._is_device_leaf", f"{_UTC}:UnifiedTreeCore._is_host_leaf",
        f"{_UTC}:UnifiedTreeNode.evicted", f"{_UTC}:_InsertPhase",
        f"{_UTC}:_InsertWalkState.key", f"{_UTC}:_InsertWalkState.total_prefix_length",
        f"{_UTC}:_InsertWalkState.value",
        f"{_COMP}.full:FullComponent.acquire_component_lock",
        f"{_COMP}.full:FullComponent.release_component_lock",
        f"{_COMP}.base:TreeComponent.reclaimable_value_len", f"{_COMP}.base:TreeComponent.value_len",
        f"{_SWA}:SWAComponent.refresh_lru", f"{_SWA}:SWAComponent.eviction_priority",
        f"{_COMP}.base:get_and_increase_time_counter",
        f"{_RADIX}:RadixKey.__init__", f"{_RADIX}:RadixKey.__len__", f"{_RADIX}:RadixKey.match_at",
        f"{_RADIX}:RadixKey.child_key_at", f"{_RADIX}:RadixKey.__getitem__",
        # ... and what it calls or reads privately
        f"{_UTC}:UnifiedTreeCore._split_node", f"{_UTC}:UnifiedTreeCore._add_new_node",
        f"{_UTC}:UnifiedTreeCore._unevict_node_on_insert",
        f"{_UTC}:UnifiedTreeCore._inc_hit_count_and_check",
        f"{_UTC}:UnifiedTreeCore._build_backup_kv_action",
        f"{_UTC}:UnifiedTreeCore._create_match_validators",
        f"{_UTC}:UnifiedTreeCore._match_post_processor",
        f"{_UTC}:UnifiedTreeCore._pending_internal_evictions",
        f"{_UTC}:UnifiedTreeCore.evictable_device_leaves", f"{_UTC}:UnifiedTreeCore.evictable_host_leaves",
        f"{_UTC}:UnifiedTreeCore.component_evictable_size_",
        f"{_UTC}:UnifiedTreeCore.component_protected_size_",
        f"{_UTC}:UnifiedTreeCore.components_by_type", f"{_UTC}:UnifiedTreeCore.components",
        f"{_UTC}:UnifiedTreeCore.is_eagle",
        f"{_UTC}:UnifiedTreeCore.enable_hicache",
        f"{_UTC}:UnifiedLRUList._remove_node", f"{_UTC}:UnifiedLRUList._add_node_after",
        f"{_COMP}.base:TreeComponent.__init__",     # sets is_evict_device_ongoing
        f"{_COMP}.base:TreeComponent.evict_device_start",
        "sglang.srt.mem_cache.base_prefix_cache:IncLockRefResult")),
    # swa_cone: re-match on full KV and plan a one-chunk replay in the PrefillAdder path; the
    # first pass copies the resident latents / index keys, masks the replay rows' writes, floors
    # their window (forward side, DSV4 attention backend).
    Hook("swa_cone", _URC, "UnifiedRadixCache.match_prefix", touches=(
        f"{_URC}:UnifiedRadixCache._match_tree", f"{_URC}:UnifiedRadixCache.root_node_handle",
        f"{_URC}:UnifiedRadixCache.supports_swa", f"{_URC}:UnifiedRadixCache.page_size",
        f"{_URC}:UnifiedRadixCache.token_to_kv_pool_allocator",   # its get_kvcache(): the pool
        "sglang.srt.mem_cache.allocator.base:BaseTokenToKVPoolAllocator.get_kvcache",
        "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator.get_kvcache",
        f"{_UTC}:UnifiedTreeCore.collect_full_device_indices",
        "sglang.srt.mem_cache.base_prefix_cache:MatchPrefixParams",
        "sglang.srt.mem_cache.radix_cache:RadixKey.__init__",
        "sglang.srt.mem_cache.base_prefix_cache:MatchResult",
        "sglang.srt.layers.attention.attention_registry:_is_hip",
        "sglang.srt.layers.attention.attention_registry:_is_npu",
        f"{_RC}:attention_backends",
        # the engine's encoder SWA bounded replay in effect: cone declines (swa_cone.engine_replay)
        f"{_RC}:get_exec",
        "sglang.srt.arg_groups.fields.exec_:ExecFeatures.enable_encoder_swa_bounded_replay")),
    Hook("swa_cone", _POLICY, "PrefillAdder.add_one_req", touches=(
        f"{_POLICY}:PrefillAdder.can_run_list", f"{_POLICY}:PrefillAdder.tree_cache",
        f"{_URC}:UnifiedRadixCache.lock", f"{_URC}:UnifiedRadixCache.unlock",
        f"{_SB}:Req.prefix_len", f"{_SB}:Req.last_node", f"{_SB}:Req.lock",
        f"{_SB}:Req.full_untruncated_fill_ids", f"{_SB}:Req.extend_end",
        f"{_SB}:Req.num_matched_prefix_tokens", f"{_SB}:Req.swa_branching_seqlen",
        f"{_SB}:Req.host_hit_length", f"{_SB}:Req.swa_host_hit_length",
        # a request whose replay cannot be prepared is failed through the engine's discard path
        f"{_SB}:Req.finished", f"{_SB}:Req.discard_output_reason",
        f"{_SB}:Req.skip_radix_cache_insert", f"{_SB}:FINISH_ABORT.__init__",
        "sglang.srt.managers.scheduler_components.batch_result_processor:"
        "SchedulerBatchResultProcessor.process_batch_result_prefill",
        "sglang.srt.mem_cache.common:checkpoint_kv_cache",
        "sglang.srt.mem_cache.common:release_kv_cache")),
    # beside the engine's decoder SWA bounded replay (swa_cone.decoder_replay) a first pass that
    # is not the last is cut to end at F; exact because the late-layer tail's rows and window
    # floor follow each pass's end (late_layer_tail_layout, the tail metadata) and the match
    # limit keeps the last 128 prompt tokens out of every hit (_req_radix_key)
    Hook("swa_cone", _POLICY, "PrefillAdder._select_prefill_admission", touches=(
        f"{_POLICY}:_PrefillAdmission",
        "sglang.srt.arg_groups.fields.exec_:ExecFeatures.enable_decoder_swa_bounded_replay",
        "sglang.kernels.ops.attention.dsv4.attn_metadata_kernels:late_layer_tail_layout",
        f"{_DSV4}:DeepseekV4AttnBackend._build_late_layer_tail_metadata",
        "sglang.srt.mem_cache.common:_req_radix_key",
        f"{_URC}:UnifiedRadixCache.swa_reprefill_tail_tokens")),
    Hook("swa_cone", _DSV4, "DeepseekV4AttnBackend._build_forward_metadata", touches=(
        f"{_DSV4}:DeepseekV4AttnBackend._compressor_out_loc",   # sends masked rows to slot 0
        f"{_FB}:ForwardBatch.encoder_swa_compress_rows", f"{_FB}:ForwardBatch.encoder_swa_row_floor",
        f"{_FB}:ForwardBatch.encoder_swa_replay", f"{_FB}:ForwardBatch.extend_prefix_lens_cpu",
        f"{_FB}:ForwardBatch.extend_seq_lens_cpu", f"{_FB}:ForwardBatch.req_pool_indices_cpu",
        f"{_FB}:ForwardBatch.rids",
        f"{_URC}:UnifiedRadixCache._all_reduce_attn_groups",   # TP ranks agree on a failed replay
        "sglang.srt.mem_cache.deepseek_v4_memory_pool:DeepSeekV4TokenToKVPool._init_compressed_pools")),
    Hook("swa_cone", _DSV4, "DeepseekV4AttnBackend.init_forward_metadata_prefill"),
    # autotune_keep: rank agreement on loadability; launch sidecar.
    Hook("autotune_keep", _AUTOTUNE, "_autotune_cache_digest", touches=(
        "flashinfer.autotuner.autotuner:_collect_metadata",)),
    Hook("autotune_keep", _AUTOTUNE, "_drop_diverged_autotune_cache"),
    Hook("autotune_keep", _AUTOTUNE, "flashinfer_autotune_context", touches=(
        f"{_AUTOTUNE}:_autotune_tactic_sync_group", f"{_AUTOTUNE}:flashinfer_autotune_cache_path",
        f"{_AUTOTUNE}:get_parallel", f"{_AUTOTUNE}:envs")),
    # input_guard: check the fields the stock scheduler dies on (prompt ids, input_guard.FIELDS)
    # in the tokenizer manager, against the engine's declared types of its request structs, on
    # the int64 array the engine builds after its own validation; both single and batch path.
    Hook("input_guard", _TM, "TokenizerManager._create_tokenized_object", touches=(
        f"{_TM}:TokenizerManager.model_config",
        "sglang.srt.configs.model_config:ModelConfig.vocab_size",
        f"{_IO}:TokenizedGenerateReqInput.input_ids", f"{_IO}:TokenizedGenerateReqInput.mm_inputs",
        f"{_IO}:TokenizedGenerateReqInput.input_embeds",
        f"{_IO}:TokenizedGenerateReqInput.sampling_params",
        f"{_IO}:TokenizedGenerateReqInput.top_logprobs_num",
        f"{_IO}:TokenizedGenerateReqInput.logprob_start_len", f"{_IO}:TokenizedGenerateReqInput.lora_id",
        f"{_IO}:TokenizedGenerateReqInput.positional_embed_overrides",
        "sglang.srt.managers.embed_types:PositionalEmbeds",
        f"{_IO}:TokenizedEmbeddingReqInput.input_ids", f"{_IO}:TokenizedEmbeddingReqInput.mm_inputs",
        f"{_IO}:TokenizedEmbeddingReqInput.sampling_params",
        "sglang.srt.sampling.sampling_params:SamplingParams.stop_token_ids",
        # every field the check reads (the scheduler's, the sampling batch's and the model's)
        *(f"{_IO}:TokenizedGenerateReqInput.{f}" for f in (
            "rid", "session_id", "session_params", "return_logprob", "token_ids_logprob",
            "token_indices_to_pool", "multi_item_delimiter_indices")),
        *(f"{_IO}:TokenizedEmbeddingReqInput.{f}" for f in (
            "rid", "token_indices_to_pool", "multi_item_delimiter_indices")),
        *(f"{_SP}:SamplingParams.{f}" for f in (
            "max_new_tokens", "min_new_tokens", "top_k", "n", "beam_width", "temperature", "top_p",
            "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
            "stop_strs", "stop_regex_strs", "json_schema", "regex", "ebnf", "structural_tag")),
        # the tensors those numbers end up in, and the scheduler's stop_regex search (RE2 there)
        "sglang.srt.sampling.sampling_batch_info:SamplingBatchInfo.from_schedule_batch",
        f"{_SB}:Req._check_str_based_finish", f"{_SB}:Req._locate_str_stop_finished_len",
        f"{_SB}:Req.rid",
        # pooling (issue 50): the line's chunk size, and the engine's path the rule follows: the
        # scheduler's prefix limit, the forward batch's per-request tensors, the logits
        # processor's indexing of the extend rows
        f"{_TM}:TokenizerManager.server_args",
        f"{_SB}:Req._compute_max_prefix_len", f"{_SB}:Req.is_prefill_only",
        f"{_FB}:ForwardBatch.init_new",
        "sglang.srt.layers.logits_processor:LogitsProcessor.compute_logprobs_at_positions",
        "sglang.srt.layers.logits_processor:LogitsProcessor.forward")),
    # input_guard: sessions are off on the line (any client that knows a session id could use or
    # close it): opening and closing one is refused where the tokenizer manager would send it.
    # (the HTTP routes that call them, /open_session and /close_session, answer the refusal 400
    # through their own `except Exception`: tests/test_input_guard.py drives them)
    Hook("input_guard", "sglang.srt.managers.tokenizer_control_mixin", "TokenizerControlMixin.open_session"),
    Hook("input_guard", "sglang.srt.managers.tokenizer_control_mixin", "TokenizerControlMixin.close_session"),
    # input_guard: n is the one cost spent before the choke point (the engine's normalisation,
    # the first thing generate_request does, expands the request n times): bounded on the way in.
    Hook("input_guard", _TM, "TokenizerManager.generate_request", touches=(
        f"{_IO}:GenerateReqInput.sampling_params", f"{_IO}:GenerateReqInput.normalize_batch_and_arguments",
        f"{_IO}:GenerateReqInput._handle_parallel_sampling",
        # issue 50: samples bounded over the whole request (prompts x n), text before tokenizing
        f"{_IO}:GenerateReqInput.text", f"{_IO}:GenerateReqInput.input_ids",
        f"{_IO}:GenerateReqInput.input_embeds", f"{_IO}:GenerateReqInput._normalize_batch_inputs",
        f"{_TM}:TokenizerManager._tokenize_one_request",
        f"{_IO}:EmbeddingReqInput.normalize_batch_and_arguments", f"{_IO}:GenerateReqInput.image_data",
        # issue 50: prompt log-prob entries summed over the whole request before any of it is
        # sent (a text batch is tokenized and sent one prompt at a time; n > 1 sends each prompt
        # n times plus a prefix request), prompts counted as the engine decides its batch
        f"{_TM}:TokenizerManager._handle_batch_request", f"{_IO}:GenerateReqInput._determine_batch_size",
        f"{_IO}:GenerateReqInput._normalize_logprob_params", f"{_IO}:GenerateReqInput.return_logprob",
        f"{_IO}:GenerateReqInput.logprob_start_len", f"{_IO}:GenerateReqInput.top_logprobs_num",
        f"{_IO}:GenerateReqInput.token_ids_logprob",
        # issue 50, the compile pool: a client's unanswered grammar requests bounded to its share
        # of the pool the engine builds (its size), each request compiling its own grammar on a
        # cache miss (process_req_with_grammar), answered by the response generator's first output
        "sglang.srt.constrained.base_grammar_backend:BaseGrammarBackend.__init__",
        "sglang.srt.constrained.grammar_manager:GrammarManager.process_req_with_grammar",
        f"{_TM}:TokenizerManager._wait_one_response", f"{_TM}:TokenizerManager._stream_one_response")),
    # input_guard: an abort of a refused request never reaches another request (issue 50): the
    # stream's abort task aborts only the states its own request registered.
    Hook("input_guard", _TM, "TokenizerManager._init_req_state", touches=(
        f"{_TM}:TokenizerManager.rid_to_state", f"{_IO}:GenerateReqInput.is_single",
        f"{_IO}:GenerateReqInput.rid")),
    Hook("input_guard", _TM, "TokenizerManager.create_abort_task", touches=(
        f"{_TM}:TokenizerManager.abort_request",)),
    # input_guard: rids are exact. The scheduler's abort matches every queue by rid prefix; the
    # requests whose rid merely starts with the aborted one are hidden for its duration.
    Hook("input_guard", _SCHED, "Scheduler.abort_request", touches=(
        f"{_SCHED}:Scheduler.chunked_req", f"{_SCHED}:Scheduler.waiting_queue",
        f"{_SCHED}:Scheduler.collect_inflight_reqs", f"{_SCHED}:Scheduler.grammar_manager",
        f"{_SCHED}:Scheduler.mm_receiver", f"{_SCHED}:Scheduler.dllm_config",
        f"{_SCHED}:Scheduler.disaggregation_mode",
        "sglang.srt.constrained.grammar_manager:GrammarManager.grammar_queue",
        "sglang.srt.constrained.grammar_manager:GrammarManager.abort_requests",
        f"{_IO}:AbortReq.rid", f"{_IO}:AbortReq.abort_all", f"{_SB}:Req.rid")),
    # input_guard: a grammar step is time-bounded per request (xgrammar, the engine's default
    # backend): each call timed on this rank; a request over the bound (agreed below) is finished
    # through the engine's own accept_token error path, the batch goes on.
    Hook("input_guard", _XG, "XGrammarGrammar.accept_token", touches=(
        "sglang.srt.managers.scheduler_components.batch_result_processor:"
        "SchedulerBatchResultProcessor._apply_prefill_grammar",
        "sglang.srt.managers.scheduler_components.batch_result_processor:"
        "SchedulerBatchResultProcessor._accept_grammar_tokens")),
    Hook("input_guard", _XG, "XGrammarGrammar.fill_vocab_mask", touches=(
        "sglang.srt.constrained.base_grammar_backend:BaseGrammarObject.fill_vocab_mask_batched",)),
    # input_guard: the step's verdict, agreed (MAX of each grammar's slowest call) over the
    # scheduler's DP-local TP group (the group the engine agrees grammar readiness over) after
    # each batch's result, so every rank finishes the same request at the same step.
    Hook("input_guard", _SCHED, "Scheduler.process_batch_result", touches=(
        f"{_SCHED}:Scheduler.dp_tp_group", f"{_SCHED}:Scheduler.dp_tp_cpu_group",
        f"{_PS}:GroupCoordinator.world_size", f"{_RC}:get_parallel",
        f"{_RC}:ParallelContext._read",    # how attn_cp_size / pp_size resolve (published widths)
        "sglang.srt.constrained.grammar_manager:GrammarManager.grammar_sync_group",
        f"{_SB}:ScheduleBatch.reqs", f"{_SB}:Req.grammar",
        "sglang.srt.constrained.reasoner_grammar_backend:ReasonerGrammarObject.grammar",
        # the request the bound finished is answered 400 (issue 50): the FINISH_ABORT the engine
        # sets on its grammar error path, and how the tokenizer manager answers its status
        f"{_SB}:FINISH_ABORT", f"{_SB}:Req.to_finish", f"{_SB}:Req.update_finish_state",
        f"{_TM}:TokenizerManager._handle_abort_finish_reason")),
    # input_guard: the grammar caches bounded, a compile timeout never cached as the grammar's
    # verdict (issue 50): the engine caches every compile result in a dict without bound and
    # builds xgrammar's compiler with an unbounded cache.
    Hook("input_guard", _XG, "XGrammarGrammarBackend.__init__", touches=(
        f"{_XG}:XGrammarGrammarBackend._tokenizer_info", f"{_XG}:XGrammarGrammarBackend.grammar_compiler",
        f"{_XG}:XGrammarGrammarBackend.reset",
        "sglang.srt.constrained.base_grammar_backend:BaseGrammarBackend.set_cache",
        "sglang.srt.constrained.base_grammar_backend:BaseGrammarBackend.__init__",
        "sglang.srt.constrained.base_grammar_backend:BaseGrammarBackend.get_cached_or_future_value",
        "sglang.srt.constrained.base_grammar_backend:InvalidGrammarObject",
        "sglang.srt.constrained.grammar_manager:GrammarManager.get_ready_grammar_requests")),
    # input_guard: the Ollama routes (issue 50): options.seed to the engine's sampling_seed, an
    # option of a type SamplingParams cannot compare is a 400, and the engine's ValueError for a
    # client's value is a 400 as on its other routes (these routes catch nothing).
    Hook("input_guard", _OLLAMA, "OllamaServing._convert_options_to_sampling_params", touches=(
        f"{_OLLAMA}:OllamaServing.tokenizer_manager", f"{_SP}:SamplingParams.__init__",
        f"{_SP}:SamplingParams.verify", f"{_SP}:SamplingParams.sampling_seed",
        "sglang.srt.sampling.sampling_batch_info:SamplingBatchInfo.from_schedule_batch",
        "sglang.srt.layers.sampler:Sampler.forward")),
    Hook("input_guard", _OLLAMA, "OllamaServing._generate_chat_response", touches=(
        f"{_TM}:TokenizerManager._handle_abort_finish_reason", f"{_OLLAMA}:OllamaServing.handle_chat")),
    Hook("input_guard", _OLLAMA, "OllamaServing._generate_generate_response", touches=(
        f"{_OLLAMA}:OllamaServing.handle_generate",)),
    Hook("input_guard", _OLLAMA, "OllamaServing._stream_chat_response", touches=(
        "starlette.responses:StreamingResponse.__init__",)),
    Hook("input_guard", _OLLAMA, "OllamaServing._stream_generate_response"),
    # input_guard: once the launcher builds its tokenizer manager (the HTTP module and its app
    # exist, uvicorn not yet serving), the routes whose handler builds a request of the body
    # itself (/vertex_generate: GenerateReqInput(**parameters), a TypeError 500 for a name it does
    # not have) get the body checked first, and the parse routes their text bounded (issue 50).
    # (the HTTP module's own internals it touches: INFRA_TOUCHES["input_guard.routes"], checked
    # when the routes are wrapped: this row installs while the HTTP module is still importing)
    Hook("input_guard", _TM, "TokenizerManager.__init__", touches=(
        f"{_IO}:VertexGenerateReqInput", f"{_IO}:GenerateReqInput",
        f"{_IO}:ParseFunctionCallReq", f"{_IO}:SeparateReasoningReqInput",
        # the text bound's default: 8 characters per token of the context length it serves
        f"{_TM}:TokenizerManager.context_len")),
    # admin_guard: where the engine adds its auth middleware (before uvicorn starts), add ours
    # when no admin key is configured: ADMIN_OPTIONAL routes get the engine's ADMIN_FORCE answer
    # (403) through the engine's own route match and decision; its post-warmup /freeze_gc passes.
    Hook("admin_guard", _HTTP, "_setup_and_run_http_server", touches=(
        f"{_HTTP}:app", f"{_HTTP}:get_serving",
        f"{_SERVING}:Serving.api_key", f"{_SERVING}:Serving.admin_api_key",
        f"{_SERVING}:Serving.tokenizer_worker_num",
        f"{_AUTH}:AuthLevel", f"{_AUTH}:AuthDecision",
        f"{_AUTH}:_get_auth_level_from_app_and_scope", f"{_AUTH}:decide_request_auth",
        f"{_AUTH}:auth_level",                      # sets the endpoint's _auth_level we read
        f"{_AUTH}:add_api_key_middleware",          # the engine's, outside ours where it adds it
        f"{_AUTH}:app_has_admin_force_endpoints")), # its gate, read by `dsv41 check`'s exposure
    Hook("admin_guard", _HTTP, "_freeze_gc_after_server_warmup", touches=(
        f"{_HTTP}:freeze_gc_async",)),              # the route its POST /freeze_gc reaches
    # admin_guard: what /server_info and /get_server_info return passes the engine's own
    # redaction whole; ours redacts --api-key / --admin-api-key there (fields and launch command).
    Hook("admin_guard", _HTTP, "redact_watermark_secrets", touches=(
        f"{_HTTP}:server_info", f"{_HTTP}:get_server_info", "sglang.srt.utils.common:build_server_info",
        "sglang.srt.managers.scheduler_components.internal_state:"
        "SchedulerInternalStateController.get_internal_state",
        f"{_SERVING}:Serving.api_key", f"{_SERVING}:Serving.admin_api_key")),
)

# What the installer and the metrics exporter touch themselves (checked with every adapter's
# install; drift in the installer's refuses every adapter, in metrics' turns exporting off).
INFRA_TOUCHES: dict[str, tuple[str, ...]] = {
    "installer": (
        "sglang.srt.plugins.hook_registry:HookRegistry.register",
        "sglang.srt.plugins.hook_registry:HookRegistry.apply_hooks",
        "sglang.srt.plugins.hook_registry:HookRegistry._apply_target",
        "sglang.srt.plugins.hook_registry:HookRegistry._hooks",
        "sglang.srt.plugins.hook_registry:HookRegistry._patched",
        "sglang.srt.plugins.hook_registry:HookSource",
        "sglang.srt.plugins.hook_registry:_wrap_fn",
        "sglang.srt.plugins.hook_registry:_propagate_patch",
    ),
    # input_guard's route wraps (issue 50), checked when it wraps them (the launcher's tokenizer
    # manager is built once the HTTP module is loaded; input_guard installs while it imports):
    # drift leaves the routes unwrapped with a fallback line
    "input_guard.routes": (
        f"{_HTTP}:app", f"{_HTTP}:vertex_generate", f"{_HTTP}:launch_server",
        f"{_HTTP}:_setup_and_run_http_server",
        # the parse routes run their parser on the HTTP event loop: text bounded before it runs
        f"{_HTTP}:parse_function_call_request", f"{_HTTP}:separate_reasoning_request",
        "fastapi.routing:APIRoute.dependant", "fastapi.routing:run_endpoint_function",
    ),
    # input_guard's text bound on the chat-like routes (issue 50), checked when it wraps them:
    # each endpoint, and the handlers whose work before generate_request it bounds (template
    # rendering, tokenizing, decoding, tool-schema validation; the chat handler skips the template
    # when input_ids are given); drift leaves the routes unwrapped with a fallback line
    "input_guard.text_routes": (
        f"{_HTTP}:app", *(f"{_HTTP}:{name}" for name in (
            "openai_v1_chat_completions", "sagemaker_chat_completions", "v1_responses_request",
            "anthropic_v1_messages", "anthropic_v1_count_tokens", "ollama_chat",
            "openai_v1_tokenize", "openai_v1_detokenize", "openai_v1_embeddings",
            "v1_rerank_request", "v1_score_request", "v1_decisions_request", "systemone_decisions")),
        f"{_OAI}.serving_base:OpenAIServingBase.handle_request",
        f"{_OAI}.serving_chat:OpenAIServingChat._validate_request",
        f"{_OAI}.serving_chat:OpenAIServingChat._process_messages",
        f"{_OAI}.serving_chat:OpenAIServingChat._convert_to_internal_request",
        f"{_OAI}.serving_tokenize:OpenAIServingTokenize._handle_non_streaming_request",
        f"{_OAI}.serving_tokenize:OpenAIServingDetokenize._handle_non_streaming_request",
        "sglang.srt.entrypoints.anthropic.serving:AnthropicServing.handle_messages",
        "sglang.srt.entrypoints.anthropic.serving:AnthropicServing.handle_count_tokens",
        f"{_OLLAMA}:OllamaServing.handle_chat",
        "fastapi.routing:APIRoute.dependant", "fastapi.routing:run_endpoint_function",
    ),
    "metrics": (
        f"{_RC}:publish", f"{_RC}:publish_role", f"{_RC}:get_context", f"{_RC}:get_observability",
        f"{_RC}:get_parallel", f"{_RC}:RuntimeContext.is_config_namespace_published",
        "sglang.srt.plugins.hook_registry:_propagate_patch",
    ),
}

# The process role whose engine publish() settles an adapter's counters (adapter/metrics.py).
COUNTING_ROLE: dict[str, str] = {      # default "scheduler"
    "input_guard": "tokenizer",         # the launcher's tokenizer manager checks and counts
    "admin_guard": "tokenizer",         # the launcher's HTTP app refuses and counts
}

ADAPTERS: tuple[str, ...] = tuple(dict.fromkeys(h.adapter for h in HOOKS))


def hooks_of(adapter: str) -> tuple[Hook, ...]:
    return tuple(h for h in HOOKS if h.adapter == adapter)


def modules_of(adapter: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(h.module for h in hooks_of(adapter)))


def _targets(adapters) -> set[str]:
    return {h.target for a in adapters for h in hooks_of(a)}


def install_groups(enabled) -> list[tuple[str, ...]]:
    """Enabled adapters joined when they share a callable; groups and members in table order."""
    groups: list[set[str]] = []
    for name in (a for a in ADAPTERS if a in enabled):
        overlapping = [g for g in groups if _targets(g) & _targets({name})]
        merged = {name}.union(*overlapping)
        groups = [g for g in groups if g not in overlapping] + [merged]
    order = ADAPTERS.index
    return sorted((tuple(sorted(g, key=order)) for g in groups), key=lambda g: order(g[0]))
