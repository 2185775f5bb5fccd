"""The whole flow on a real two-node Ray cluster (tests.raycluster): the shards tokenized by Ray
tasks (data.engine: ray), the ranks run as Ray Train workers (launch.launcher: ray), the store
on S3 (moto on the bridge address both nodes reach), through a real Prefect server; the ranks'
lines and metrics reach the flow's log and result as the local launcher's do.

The endpoint takes one key pair only, held in a Prefect Secret block that the config names
(storage.credentials_block). The nodes' environment has another pair, which it refuses: every
Ray task, Ray Train worker and evaluation that touched the store had the block's keys."""

import uuid

import pytest

from stoker.config import load_config
from tests.conftest import tiny_dict

pytestmark = pytest.mark.e2e


def _flow_run_logs(run_name: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags, LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"run:{run_name}"])))
        assert len(runs) == 1
        assert "launcher:ray" in runs[0].tags
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[runs[0].id])))
    return [log.message for log in logs]


def test_the_pipeline_on_ray_prepares_trains_and_evaluates_with_a_credentials_blocks_keys(prefect_server, ray_cluster):
    import s3fs
    from prefect.blocks.system import Secret

    from stoker.flows.pipeline import train_pipeline
    from stoker.storage import credentials

    root, options, (key_id, secret) = ray_cluster.keyed_bucket()
    bucket = root.removeprefix("s3://").split("/", 1)[0]
    with pytest.raises(PermissionError):  # the premise: the environment's keys are refused
        s3fs.S3FileSystem(**options).ls(bucket)
    block = "stoker-ray-s3-" + uuid.uuid4().hex[:8]
    Secret(value={"aws_access_key_id": key_id, "aws_secret_access_key": secret}).save(block)
    cfg = load_config(
        tiny_dict(
            root,
            run_name="ray-flow",
            storage={"root": root, "storage_options": options, "credentials_block": block},
            data={"engine": "ray"},
            ray={"address": ray_cluster.cluster.client_address},
            launch={"launcher": "ray", "num_nodes": 2, "nproc_per_node": 1},
            eval={"per_checkpoint_enabled": True},
        )
    )
    try:
        result = train_pipeline(cfg)
    finally:
        credentials.use(None)
    assert (result.final_step, result.resumed_from_step) == (8, 0)
    assert [s for s, _ in result.val_losses] == [0, 4, 8]
    assert result.last_train_loss < result.first_train_loss
    assert [(c["step"], c["val_loss"] is not None) for c in result.checkpoints] == [(4, True), (8, True)]
    assert result.tokens_per_second > 0 and result.num_attempts == 1
    logs = _flow_run_logs("ray-flow")
    assert any("Ray Train worker(s) on ray://" in m for m in logs), logs[:20]
    assert any(m.startswith("[rank 1] ") for m in logs) or any("[rank 1]" in m for m in logs)
    assert any("step 8" in m for m in logs), [m for m in logs if "step" in m][:10]
