"""Every span, metric, attribute and log-field name, unit and bucket, in one place.

Dashboards and tests import these. Metric names are the OTel instrument names; the Prometheus exporter
adds `_total` to counters and the unit (`_seconds`) to durations. `PROM_*` are the names as scraped.
"""

from __future__ import annotations

from typing import Final

from ddtree.observer import ALL_STAGES as ALL_STAGES

# Stages of one decode step, in order: the observer protocol's names (`ddtree.observer`), which the engine
# calls its hooks with; the spans and the stage label below are named after them.
from ddtree.observer import STAGE_ACCEPT as STAGE_ACCEPT
from ddtree.observer import STAGE_DECIDE as STAGE_DECIDE
from ddtree.observer import STAGE_DRAFT as STAGE_DRAFT
from ddtree.observer import STAGE_TREE_BUILD as STAGE_TREE_BUILD
from ddtree.observer import STAGE_VERIFY as STAGE_VERIFY
from ddtree.observer import STAGES as STAGES

# Spans.
SPAN_PREFIX: Final = "ddtree."
SPAN_STEP: Final = "ddtree.step"
SPAN_REQUEST: Final = "ddtree.request"
INSTRUMENTATION_SCOPE: Final = "ddtree"


def stage_span_name(stage: str) -> str:
    """`draft` -> `ddtree.draft`."""
    return SPAN_PREFIX + stage


# Step span attributes.
ATTR_METHOD: Final = "ddtree.method"
ATTR_BATCH_SIZE: Final = "ddtree.batch_size"  # requests that decoded in the step
ATTR_ROWS: Final = "ddtree.rows"  # rows the step ran
ATTR_WARMUP: Final = "ddtree.warmup"  # the step carried compilation or graph capture
ATTR_BUDGET: Final = "ddtree.budget"
ATTR_PREDICTED_GAIN: Final = "ddtree.predicted_gain"  # an adaptive step: its predicted tokens/s over ar's
ATTR_TOPK: Final = "ddtree.topk"
ATTR_TREE_NODES: Final = "ddtree.tree.nodes"
ATTR_TREE_DEPTH: Final = "ddtree.tree.depth"
ATTR_ACCEPTED_TOKENS: Final = "ddtree.accepted_tokens"
ATTR_MEAN_ACCEPTANCE: Final = "ddtree.mean_acceptance_length"
ATTR_STEP_INDEX: Final = "ddtree.step.index"
ATTR_REQUEST_ID: Final = "ddtree.request.id"

# Request span attributes (OTel GenAI semantic conventions).
GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"
GEN_AI_SYSTEM: Final = "gen_ai.system"
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS: Final = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE: Final = "gen_ai.request.temperature"
GEN_AI_REQUEST_SEED: Final = "gen_ai.request.seed"
GEN_AI_USAGE_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
GEN_AI_PROMPT: Final = "gen_ai.prompt"  # content: only with DDTREE_LOG_CONTENT=1
GEN_AI_COMPLETION: Final = "gen_ai.completion"  # content: only with DDTREE_LOG_CONTENT=1
GEN_AI_PROVIDER_NAME: Final = "gen_ai.provider.name"  # what newer GenAI conventions call gen_ai.system
GEN_AI_OPERATION_TEXT_COMPLETION: Final = "text_completion"
GEN_AI_OPERATION_CHAT: Final = "chat"
GEN_AI_SYSTEM_DDTREE: Final = "ddtree"

# Metrics: instrument names, as the OTel SDK sees them.
METRIC_STEPS: Final = "ddtree_steps"
METRIC_DRAFT_TOKENS: Final = "ddtree_draft_tokens"
METRIC_ACCEPTED_TOKENS: Final = "ddtree_accepted_tokens"
METRIC_EMITTED_TOKENS: Final = "ddtree_emitted_tokens"
METRIC_ACCEPTED_PER_DEPTH: Final = "ddtree_accepted_tokens_per_depth"
METRIC_TREE_NODES_PER_DEPTH: Final = "ddtree_tree_nodes_per_depth"
# The tree against its chain, by depth (`telemetry.chain`), from the accepted path's ranks.
METRIC_OFF_CHAIN_ACCEPTED_PER_DEPTH: Final = "ddtree_off_chain_accepted_tokens_per_depth"  # rank > 0
METRIC_TREE_ADDED_PER_DEPTH: Final = "ddtree_tree_added_tokens_per_depth"  # at or below the first rank > 0
METRIC_OFF_CHAIN_PARENT_ACCEPTED_PER_DEPTH: Final = "ddtree_off_chain_parent_accepted_tokens_per_depth"
METRIC_OFF_CHAIN_PARENT_NODES_PER_DEPTH: Final = "ddtree_off_chain_parent_nodes_per_depth"  # offered
# The drafter's prediction against what was accepted, per request step: their sums and the sum of |difference|.
METRIC_PREDICTED_ACCEPTED: Final = "ddtree_predicted_accepted_tokens"
METRIC_PREDICTION_ERROR: Final = "ddtree_prediction_abs_error_tokens"
METRIC_PREDICTED_STEPS: Final = "ddtree_predicted_steps"  # request steps that carried a prediction
METRIC_ACCEPTANCE_LENGTH: Final = "ddtree_acceptance_length"
METRIC_TREE_NODES: Final = "ddtree_tree_nodes"
METRIC_STAGE_DURATION: Final = "ddtree_stage_duration"
METRIC_GPU_UTILIZATION: Final = "ddtree_gpu_utilization"
METRIC_GPU_MEMORY_USED: Final = "ddtree_gpu_memory_used"
METRIC_GPU_POWER: Final = "ddtree_gpu_power"
METRIC_GPU_SM_CLOCK: Final = "ddtree_gpu_sm_clock"
METRIC_GPU_TEMPERATURE: Final = "ddtree_gpu_temperature"
METRIC_DROPPED_SPANS: Final = "ddtree_dropped_spans"
METRIC_EXPORT_FAILURES: Final = "ddtree_telemetry_export_failures"  # LABEL_SIGNAL: traces, metrics

UNIT_SECONDS: Final = "s"
UNIT_PERCENT: Final = "percent"
UNIT_BYTES: Final = "By"
UNIT_WATTS: Final = "W"
UNIT_HERTZ: Final = "Hz"
UNIT_CELSIUS: Final = "Cel"

# Metric attributes.
LABEL_DEPTH: Final = "depth"
LABEL_STAGE: Final = "stage"
LABEL_METHOD: Final = "method"
LABEL_GPU: Final = "gpu"
LABEL_KIND: Final = "kind"
LABEL_SIGNAL: Final = "signal"
DROPPED_STEP: Final = "step"  # LABEL_KIND values: a step record, a request's start or end record
DROPPED_REQUEST: Final = "request"

# The names Prometheus serves.
PROM_STEPS_TOTAL: Final = "ddtree_steps_total"
PROM_DRAFT_TOKENS_TOTAL: Final = "ddtree_draft_tokens_total"
PROM_ACCEPTED_TOKENS_TOTAL: Final = "ddtree_accepted_tokens_total"
PROM_EMITTED_TOKENS_TOTAL: Final = "ddtree_emitted_tokens_total"
PROM_ACCEPTED_PER_DEPTH_TOTAL: Final = "ddtree_accepted_tokens_per_depth_total"
PROM_TREE_NODES_PER_DEPTH_TOTAL: Final = "ddtree_tree_nodes_per_depth_total"
PROM_OFF_CHAIN_ACCEPTED_PER_DEPTH_TOTAL: Final = "ddtree_off_chain_accepted_tokens_per_depth_total"
PROM_TREE_ADDED_PER_DEPTH_TOTAL: Final = "ddtree_tree_added_tokens_per_depth_total"
PROM_OFF_CHAIN_PARENT_ACCEPTED_PER_DEPTH_TOTAL: Final = "ddtree_off_chain_parent_accepted_tokens_per_depth_total"
PROM_OFF_CHAIN_PARENT_NODES_PER_DEPTH_TOTAL: Final = "ddtree_off_chain_parent_nodes_per_depth_total"
PROM_ACCEPTANCE_LENGTH: Final = "ddtree_acceptance_length"
PROM_TREE_NODES: Final = "ddtree_tree_nodes"
PROM_STAGE_DURATION_SECONDS: Final = "ddtree_stage_duration_seconds"
PROM_DROPPED_RECORDS_TOTAL: Final = "ddtree_telemetry_dropped_records_total"

# The HTTP server's metrics (`ddtree serve`, prometheus_client on the server's own /metrics): names as
# scraped.
PROM_HTTP_REQUESTS_TOTAL: Final = "ddtree_http_requests_total"
PROM_HTTP_REQUEST_DURATION_SECONDS: Final = "ddtree_http_request_duration_seconds"
PROM_TIME_TO_FIRST_TOKEN_SECONDS: Final = (
    "gen_ai_server_time_to_first_token_seconds"  # OTel GenAI: gen_ai.server.time_to_first_token
)
PROM_TIME_PER_OUTPUT_TOKEN_SECONDS: Final = (
    "gen_ai_server_time_per_output_token_seconds"  # gen_ai.server.time_per_output_token
)
PROM_GENERATED_TOKENS_TOTAL: Final = "ddtree_generated_tokens_total"  # by endpoint; as generation_tokens below
PROM_WAITING_REQUESTS: Final = "ddtree_waiting_requests"
PROM_RUNNING_REQUESTS: Final = "ddtree_running_requests"
PROM_SLOTS: Final = "ddtree_slots"  # the decode session's slots (--max-batch-size): running / slots is slot use
# Per request, by the GenAI labels below (vLLM's counterpart after each).
PROM_REQUEST_DURATION_SECONDS: Final = "gen_ai_server_request_duration_seconds"  # vllm:e2e_request_latency_seconds
PROM_PROMPT_TOKENS_TOTAL: Final = "ddtree_prompt_tokens_total"  # vllm:prompt_tokens_total
PROM_GENERATION_TOKENS_TOTAL: Final = "ddtree_generation_tokens_total"  # vllm:generation_tokens_total
PROM_REQUEST_SUCCESS_TOTAL: Final = "ddtree_request_success_total"  # vllm:request_success_total{finished_reason}
PROM_REQUEST_QUEUE_TIME_SECONDS: Final = "ddtree_request_queue_time_seconds"  # vllm:request_queue_time_seconds
PROM_REQUEST_PREFILL_TIME_SECONDS: Final = "ddtree_request_prefill_time_seconds"  # vllm:request_prefill_time_seconds
# Speculative decoding, always on, from the acceptance lengths and budgets each request is handed (by method
# and model; vLLM's counterpart after each). A draft is one request's tree in one decode step.
PROM_SPEC_DRAFTS_TOTAL: Final = "ddtree_spec_decode_drafts_total"  # vllm:spec_decode_num_drafts; + budget
PROM_SPEC_DRAFT_TOKENS_TOTAL: Final = "ddtree_spec_decode_draft_tokens_total"  # vllm:spec_decode_num_draft_tokens
PROM_SPEC_ACCEPTED_TOKENS_TOTAL: Final = (
    "ddtree_spec_decode_accepted_tokens_total"  # vllm:spec_decode_num_accepted_tokens
)
PROM_SPEC_ACCEPTED_PER_POS_TOTAL: Final = (
    "ddtree_spec_decode_accepted_tokens_per_pos_total"  # vllm:spec_decode_num_accepted_tokens_per_pos{position}
)
PROM_SPEC_REQUEST_ACCEPTANCE_LENGTH: Final = (
    "ddtree_spec_decode_request_acceptance_length"  # per request: the mean of its steps' acceptance lengths
)
LABEL_ENDPOINT: Final = "endpoint"
LABEL_STATUS: Final = "status"
LABEL_MODEL: Final = "model_name"  # vLLM's label for the served model
LABEL_BUDGET: Final = "budget"  # a step's draft nodes (0: an ar step)
LABEL_POSITION: Final = "position"  # a draft's depth in the tree, 1 for the root's children (vLLM counts from 0)
LABEL_FINISHED_REASON: Final = "finished_reason"  # stop, length, abort (cancelled, client gone), error
LABEL_GEN_AI_OPERATION: Final = "gen_ai_operation_name"  # the GenAI attributes as Prometheus labels
LABEL_GEN_AI_MODEL: Final = "gen_ai_request_model"
LABEL_GEN_AI_PROVIDER: Final = "gen_ai_provider_name"
GEN_AI_LABELS: Final = (LABEL_GEN_AI_OPERATION, LABEL_GEN_AI_MODEL, LABEL_GEN_AI_PROVIDER)
FINISHED_ABORT: Final = "abort"  # LABEL_FINISHED_REASON values past the responses' "stop" and "length"
FINISHED_ERROR: Final = "error"
FINISHED_REASONS: Final = ("stop", "length", FINISHED_ABORT, FINISHED_ERROR)

# Histogram buckets.
ACCEPTANCE_LENGTH_BUCKETS: Final = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0, 24.0, 32.0)
TREE_NODES_BUCKETS: Final = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0)
STAGE_DURATION_BUCKETS: Final = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
HTTP_DURATION_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TIME_TO_FIRST_TOKEN_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TIME_PER_OUTPUT_TOKEN_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# OTel GenAI's advice for gen_ai.server.request.duration.
REQUEST_DURATION_BUCKETS: Final = (
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
)
QUEUE_TIME_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REQUEST_ACCEPTANCE_LENGTH_BUCKETS: Final = (
    1.0,
    1.25,
    1.5,
    1.75,
    2.0,
    2.5,
    3.0,
    3.5,
    4.0,
    5.0,
    6.0,
    8.0,
    10.0,
    12.0,
    16.0,
)

# Log events and fields.
EVENT_STEP: Final = "ddtree.step"
EVENT_REQUEST: Final = "ddtree.request"
EVENT_TELEMETRY: Final = "ddtree.telemetry"
FIELD_STEP: Final = "step"
FIELD_METHOD: Final = "method"
FIELD_ACTIVE_REQUESTS: Final = "active_requests"  # requests that decoded in the step (len of request_ids)
FIELD_ROWS: Final = "rows"  # rows the step ran: slots 0..rows-1, free and finished ones included
FIELD_BATCH_SIZE: Final = "batch_size"  # logs written before `active_requests` and `rows`: read only
FIELD_WARMUP: Final = "warmup"  # the step carried compilation or graph capture: not steady-state work
FIELD_BUDGET: Final = "budget"
FIELD_TOPK: Final = "topk"
FIELD_TREE_NODES: Final = "tree_nodes"
FIELD_NODES_PER_DEPTH: Final = "nodes_per_depth"
FIELD_ACCEPTED_DRAFTS: Final = "accepted_drafts"
# The drafter's prediction (`telemetry.calibration`): per request, the expected accepted drafts of the tree the
# step ran (beside `accepted_drafts`), and at each of the widths `predicted_widths` (the last: the tree run).
FIELD_PREDICTED_ACCEPTED: Final = "predicted_accepted"
FIELD_PREDICTED_WIDTHS: Final = "predicted_widths"
FIELD_PREDICTED_AT_WIDTHS: Final = "predicted_accepted_at_widths"
FIELD_PREDICTED_GAIN: Final = "predicted_gain"  # an adaptive step: the width it chose, over ar, in tokens/s
FIELD_ACCEPTED_PER_DEPTH: Final = "accepted_per_depth"
FIELD_ACCEPTED_RANKS: Final = "accepted_ranks"  # per request: each accepted draft's rank at its depth (0: top-1)
FIELD_OFF_CHAIN_PARENT_NODES_PER_DEPTH: Final = "off_chain_parent_nodes_per_depth"  # nodes whose parent is off chain
FIELD_STAGE_MS: Final = "stage_ms"
FIELD_REQUEST_IDS: Final = "request_ids"
FIELD_TRACE_ID: Final = "trace_id"
FIELD_EMITTED: Final = "emitted"
FIELD_REQUEST_ID: Final = "request_id"
FIELD_PROMPT_TOKENS: Final = "prompt_tokens"
FIELD_OUTPUT_TOKENS: Final = "output_tokens"
FIELD_STEPS: Final = "steps"
FIELD_MEAN_ACCEPTANCE: Final = "mean_acceptance_length"
FIELD_FINISH_REASON: Final = "finish_reason"
FIELD_PROMPT_TOKEN_IDS: Final = "prompt_token_ids"  # content: only with DDTREE_LOG_CONTENT=1
FIELD_OUTPUT_TOKEN_IDS: Final = "output_token_ids"  # content: only with DDTREE_LOG_CONTENT=1

# `ddtree.telemetry` lines that account for records telemetry dropped (a sink that could not keep up).
FIELD_DROPPED_STEPS: Final = "dropped_steps"  # how many step records were dropped since the last such line
FIELD_DROPPED_STEP_IDS: Final = "dropped_step_ids"  # their session step indices
FIELD_DROPPED_REQUESTS: Final = "dropped_requests"  # request records (start or end) dropped
FIELD_DROPPED_REQUEST_IDS: Final = "dropped_request_ids"
FIELD_DROPPED_TOTAL: Final = "dropped_total"  # records dropped since telemetry started, all kinds
FIELD_EXPORT_SIGNAL: Final = "signal"  # export failure lines: traces or metrics
FIELD_EXPORT_ENDPOINT: Final = "endpoint"
FIELD_EXPORT_CAUSE: Final = "cause"

# Replay and analysis fields (`ddtree advise`, `ddtree analyze`).
FIELD_START_NS: Final = "start_ns"  # step start, wall-clock ns since the epoch
FIELD_END_NS: Final = "end_ns"
FIELD_NODE_RANKS: Final = "node_ranks"  # per request, per draft node 1..n: the largest rank at its depth on its path
FIELD_NODE_LOG_PROBS: Final = "node_log_probs"  # per request, per draft node 1..n: the drafter's log-probability
FIELD_ACCEPTED_PATHS: Final = "accepted_paths"  # request line: per step, the accepted draft nodes' indices
FIELD_PATH_STEPS: Final = "path_steps"  # request line: the session step of each entry of accepted_paths
EVENT_GPU: Final = "ddtree.gpu"  # one NVML sample per GPU
FIELD_TIME_NS: Final = "time_ns"  # wall-clock ns since the epoch
FIELD_GPU: Final = "gpu"
FIELD_GPU_UTILIZATION: Final = "utilization_percent"
FIELD_GPU_MEMORY_USED: Final = "memory_used_bytes"
FIELD_GPU_POWER: Final = "power_watts"
