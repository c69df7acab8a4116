"""The metric contract (docs/design.md) as the tests check it, in one place for the service and
deployment tests."""

# the names as exported (counters with _total)
CONTRACT_METRICS = frozenset(
    {
        "dflash_ready",
        "dflash_drafters_ready",
        "dflash_drafters_expected",
        "dflash_warmup_seconds",
        "dflash_compiles_total",
        "dflash_train_tokens_total",
        "dflash_train_tokens_per_second",
        "dflash_train_step_seconds",
        "dflash_train_loss",
        "dflash_train_accuracy",
        "dflash_train_expected_acceptance_length",
        "dflash_eval_acceptance_length",
        "dflash_queue_depth",
        "dflash_jobs",
        "dflash_cuda_allocated_bytes",
        "dflash_cuda_reserved_bytes",
        "dflash_cuda_active_bytes",
        "dflash_cuda_inactive_split_bytes",
        "dflash_cuda_peak_reserved_bytes",
        "dflash_cuda_alloc_retries_total",
        "dflash_cuda_ooms_total",
        "dflash_train_learning_rate",
        "dflash_train_grad_norm",
        "dflash_checkpoint_pause_seconds",
        "dflash_build_info",
        "dflash_ranks_ready",
        "dflash_ranks_expected",
        "dflash_generate_tokens_total",
        "dflash_generate_tokens_per_second",
        "dflash_published_version",
        "dflash_published_acceptance_length",
        "dflash_candidate_acceptance_length",
        "dflash_records_ingested_total",
        "dflash_records_pending",
        "dflash_target_swaps_total",
        "dflash_target_swap_seconds",
    }
)

# the gauges labelled `job_id` with the job whose values they hold (service/metrics.py); never
# `job`, which Prometheus sets on every scraped series to the scrape job's name
PER_JOB_GAUGES = (
    "dflash_train_loss",
    "dflash_train_accuracy",
    "dflash_train_learning_rate",
    "dflash_train_grad_norm",
    "dflash_train_expected_acceptance_length",
    "dflash_eval_acceptance_length",
    "dflash_data_prepare_progress_ratio",
    "dflash_data_prepare_tokens",
)

# the regeneration jobs' series, labelled with their job like the gauges above
PER_JOB_GENERATE = ("dflash_generate_tokens_total", "dflash_generate_tokens_per_second")

# the continual jobs' series, labelled `job_id` (a label Prometheus keeps as it is)
PER_JOB_CONTINUAL = (
    "dflash_published_version",
    "dflash_published_acceptance_length",
    "dflash_candidate_acceptance_length",
    "dflash_records_ingested_total",
    "dflash_records_pending",
    "dflash_target_swaps_total",
    "dflash_target_swap_seconds",
)
