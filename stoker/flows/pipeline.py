"""The DAG of a pretraining run. Thin: task calls only; the work lives in tasks/ and below.

from stoker.flows.pipeline import train_pipeline
result = train_pipeline(config)   # a PipelineResult
"""

# no `from __future__ import annotations`: a served flow resolves its parameter types at
# run time, and string annotations of the nested prepare_data flow would not resolve
from prefect import flow, get_run_logger

from stoker.config import DataConfig, EvalConfig, RayConfig, RunConfig, StorageConfig, TokenizerConfig
from stoker.contracts.results import DataShards, PipelineResult
from stoker.failures import SHARDS_DAMAGED, TrainingFailed
from stoker.flows import fails_in_one_line
from stoker.flows.runs import claim_flow_run, flow_runs_tagged, results_of, tag_flow_run
from stoker.orchestration.credentials import use_store_credentials
from stoker.orchestration.prefect_events import flow_run_failed
from stoker.orchestration.progress import show_data_stages
from stoker.tasks.data import (
    dedup_and_decontaminate,
    download_dataset,
    filter_documents,
    tokenize_and_shard,
    train_tokenizer,
)
from stoker.tasks.evaluation import evaluate_checkpoint
from stoker.tasks.lease import run_lease
from stoker.tasks.policy import with_run_name
from stoker.tasks.report import report
from stoker.tasks.training import (
    find_resume_checkpoint,
    launch_training,
    validate_config,
    write_run_config,
)


def _run_name() -> str:
    """The flow run's name: the stoker run's (Prefect's random names say nothing), and from
    its second flow run on, which one: `run (flow run 3)` (a resume, a scheduled run)."""
    from prefect.runtime import flow_run

    config = flow_run.parameters.get("config")
    try:
        config = config if isinstance(config, RunConfig) else RunConfig.model_validate(config or {})
        run = config.resolved_run_name()
    except Exception:  # the flow's first task reports the config's problems
        return "train-pipeline (config to check)"
    earlier = flow_runs_tagged(f"run:{run}")
    return run if not earlier else f"{run} (flow run {earlier + 1})"


@flow(name="prepare-data", log_prints=True)
@fails_in_one_line
def prepare_data(
    data: DataConfig,
    tokenizer: TokenizerConfig,
    storage: StorageConfig,
    ray: RayConfig | None = None,
    run: str | None = None,
    evaluation: EvalConfig | None = None,
) -> DataShards:
    """Download each source -> the quality filters (data.filters) -> remove duplicates and evaluation items (data.dedup,
    data.decontaminate, against the sets of `evaluation`) -> one tokenizer -> tokenize and shard each source; each task is a
    no-op when its output exists (its task run shows Cached, and its result says cache_hit).
    The sources' downloads run concurrently, then their tokenizations (one task per source).
    `ray`: the cluster of data.engine 'ray' (empty: a local Ray instance). `run`: the run whose
    own trained tokenizer is kept when its data changed."""
    claim_flow_run()  # its owner process, so a dead one's run ends Crashed, not Running
    use_store_credentials(storage)  # a credentials block named in storage, when run on its own
    sources, mixture = data.source_configs(), data.is_mixture()
    downloads = [per_source(download_dataset, name, mixture).submit(cfg, storage, name) for name, _, cfg in sources]
    downloaded = results_of(downloads)
    filtered = filter_documents(downloaded, data, storage, ray, run)
    deduped = dedup_and_decontaminate([ds for ds, _ in filtered], data, evaluation, storage, ray, run)
    datasets = [dataset for dataset, _ in deduped]
    tok = train_tokenizer(datasets, tokenizer, storage, run)
    shards = [
        per_source(tokenize_and_shard, name, mixture).submit(dataset, tok, cfg, storage, ray, name)
        for dataset, (name, _, cfg) in zip(datasets, sources)
    ]
    out = DataShards(
        results_of(shards),
        mixture=mixture,
        dedup=[info for _, info in deduped],
        downloads=downloaded,
        filtered=[info for _, info in filtered if info is not None],
    )
    show_data_stages(out, run)
    return out


def per_source(task, name: str, mixture: bool):
    """A data task's run for one source of a mixture, named for it in the UI ('tokenize_and_shard[web]')."""
    return with_run_name(task, f"{task.name}[{name}]") if mixture else task


def _prepare(config: RunConfig) -> tuple[DataShards, str]:
    shards = prepare_data(
        config.data,
        config.tokenizer,
        config.storage,
        config.ray,
        run=config.resolved_run_name(),
        evaluation=config.eval,
    )
    return shards, write_run_config(config, shards)


def _train(config: RunConfig, config_url: str, shards: DataShards):
    resume = find_resume_checkpoint(config)
    launch = launch_training.with_options(retries=config.launch.max_attempts - 1)
    return resume, launch(config, config_url, shards, resume)


# any failure (data, tokenizer, resume search, lease, training) sends stoker.run.failed, once
@flow(name="train-pipeline", log_prints=True, flow_run_name=_run_name, on_failure=[flow_run_failed])
@fails_in_one_line
def train_pipeline(config: RunConfig | None = None) -> PipelineResult:
    """Prepare data, resume or start training on a torchrun gang, evaluate, report."""
    claim_flow_run()  # its owner process, so a dead one's run ends Crashed, not Running
    config = validate_config(config or RunConfig())
    tag_flow_run(
        f"run:{config.resolved_run_name()}",
        f"recipe:{config.recipe or 'custom'}",
        f"launcher:{config.launch.launcher}",
        f"world:{config.launch.num_nodes}x{config.launch.nproc_per_node}",
    )
    with run_lease(config):  # one writer per run: a second launch refuses here, before any work
        shards, config_url = _prepare(config)
        try:
            resume, training = _train(config, config_url, shards)
        except TrainingFailed as err:
            if err.reason != SHARDS_DAMAGED:
                raise
            # the ranks marked the set invalid in the store: the data stage rebuilds it alone
            # (the other sources' tasks are Cached); a second damage fails the run
            get_run_logger().warning(
                "%s. The flow rebuilds that shard set now and launches again, once.", str(err).split("\n", 1)[0]
            )
            shards, config_url = _prepare(config)
            resume, training = _train(config, config_url, shards)
        evaluation = evaluate_checkpoint(config, config_url, training.final_checkpoint_key, shards.key)
    return report(config, shards, resume, training, evaluation)
