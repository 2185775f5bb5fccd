"""No secret is ever written down: a whole pipeline on the S3 endpoint with known fake
credentials in the environment (where s3fs, the ranks and the evaluations find them), then
every object in the bucket, the Prefect database (flow run parameters, logs, artifacts) and
the host cache are scanned for them. And a config that holds credentials is refused without
repeating them."""

import os
import uuid

import pytest

from stoker.config import load_config
from stoker.failures import ConfigError
from tests.conftest import tiny_dict

pytestmark = pytest.mark.e2e


def _scan_bytes(data: bytes, needles: list[bytes]) -> bool:
    return any(n in data for n in needles)


def _prefect_db_files() -> list[str]:
    import prefect.settings

    url = str(prefect.settings.PREFECT_SERVER_DATABASE_CONNECTION_URL.value())
    path = url.split(":///", 1)[-1]
    return [p for p in (path, path + "-wal", path + "-shm") if os.path.exists(p)]


def _fake_credentials() -> tuple[str, str]:
    return "AKIASTOKER" + uuid.uuid4().hex[:10].upper(), "stoker-fake-secret-" + uuid.uuid4().hex


def _run_and_scan(s3_root, key_id: str, secret: str, nproc: int = 2, **storage) -> None:
    """A whole pipeline on the S3 endpoint (`nproc` ranks, one checkpoint, evaluated in a
    process of its own), then every object of the bucket, the Prefect database (+ WAL) and the
    host cache scanned for the credentials: zero hits."""
    import s3fs

    from stoker.flows.pipeline import train_pipeline

    root, options = s3_root
    cfg = load_config(
        tiny_dict(
            root,
            run_name="secrets",
            train={"max_steps": 4},
            checkpoint={"interval_steps": 4},
            eval={"interval_steps": 4, "per_checkpoint_enabled": True},
            launch={"nproc_per_node": nproc},
        )
    )
    cfg = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"storage_options": options, **storage})})
    result = train_pipeline(cfg)
    assert result.final_step == 4 and result.checkpoints and result.last_val_loss is not None

    needles = [key_id.encode(), secret.encode()]
    fs = s3fs.S3FileSystem(**options, key=key_id, secret=secret)
    bucket = root.removeprefix("s3://").split("/", 1)[0]
    fs.pipe(f"{bucket}/planted", secret.encode())  # the scan must be able to find one
    objects = fs.find(bucket)
    hits = [p for p in objects if _scan_bytes(fs.cat(p), needles)]
    assert hits == [f"{bucket}/planted"], hits
    assert len(objects) > 10  # it scanned a whole run: datasets, shards, config, checkpoints ...

    dbs = _prefect_db_files()
    assert dbs, "no Prefect database found to scan"
    assert not [p for p in dbs if _scan_bytes(open(p, "rb").read(), needles)]
    cache = os.environ["STOKER_CACHE"]
    for folder, _, files in os.walk(cache):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                assert not _scan_bytes(f.read(), needles), os.path.join(folder, name)


def test_credentials_from_the_environment_are_written_nowhere(prefect_server, s3_root, monkeypatch):
    key_id, secret = _fake_credentials()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    # one rank: every process inherits the environment alike (the block test below keeps two)
    _run_and_scan(s3_root, key_id, secret, nproc=1)


def _no_credentials_in_the_environment(monkeypatch):
    """Nothing for botocore to find: what opens the store must come from the block."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_credentials_from_a_prefect_secret_block_reach_every_process_and_are_written_nowhere(
    prefect_server, s3_root, monkeypatch
):
    """No credentials in the environment: the flow loads the Secret block named in the config,
    its tasks open the store with them and the ranks and evaluations get them as AWS_*
    variables (each of them writes to the bucket, so each had them)."""
    import s3fs
    from prefect.blocks.system import Secret

    from stoker.storage import credentials

    key_id, secret = _fake_credentials()
    name = "stoker-s3-" + uuid.uuid4().hex[:8]
    Secret(value={"aws_access_key_id": key_id, "aws_secret_access_key": secret}).save(name)
    _no_credentials_in_the_environment(monkeypatch)
    root, options = s3_root
    with pytest.raises(Exception, match="Unable to locate credentials"):  # the test's premise
        s3fs.S3FileSystem(**{**options, "skip_instance_cache": True}).ls(root.removeprefix("s3://"))
    try:
        _run_and_scan(s3_root, key_id, secret, credentials_block=name)
    finally:
        credentials.use(None)


def test_a_missing_or_wrong_credentials_block_is_one_config_error(prefect_server, tmp_path):
    from prefect.blocks.system import Secret

    from stoker.flows.pipeline import train_pipeline

    cfg = load_config(tiny_dict(f"file://{tmp_path}/store"))
    missing = cfg.model_copy(
        update={
            "storage": cfg.storage.model_copy(update={"credentials_block": "no-such-block-" + uuid.uuid4().hex[:6]})
        }
    )
    with pytest.raises(
        ConfigError, match=r"storage.credentials_block: no Prefect block 'secret/no-such-block-.*create it"
    ):
        train_pipeline(missing)
    secret = "stoker-fake-" + uuid.uuid4().hex
    name = "not-aws-" + uuid.uuid4().hex[:6]
    Secret(value={"password": secret}).save(name)
    wrong = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"credentials_block": name})})
    with pytest.raises(ConfigError, match="does not hold AWS credentials") as err:
        train_pipeline(wrong)
    assert secret not in str(err.value)
    assert not os.path.exists(tmp_path / "store" / "datasets")  # refused before any work


def test_a_config_holding_credentials_is_refused_without_repeating_them():
    secret = "stoker-fake-" + uuid.uuid4().hex
    with pytest.raises(ConfigError) as err:
        load_config(
            tiny_dict(
                "s3://bucket/root",
                storage={
                    "root": "s3://bucket/root",
                    "storage_options": {
                        "endpoint_url": "http://127.0.0.1:9",
                        "client_kwargs": {"aws_secret_access_key": secret},
                    },
                },
                data={"source": "s3://bucket/corpus.jsonl", "storage_options": {"token": secret}},
            )
        )
    text = str(err.value)
    assert secret not in text
    assert "storage.storage_options: holds credentials (client_kwargs.aws_secret_access_key)" in text
    assert "data.storage_options: holds credentials (token)" in text and "AWS_ACCESS_KEY_ID" in text


def test_an_aws_credentials_block_gives_the_store_and_the_ranks_its_keys_and_shows_none(prefect_server):
    """prefect-aws's AwsCredentials block, named 'aws-credentials/NAME': the keys reach fsspec
    and the AWS_* variables of the processes stoker starts, and no repr shows them."""
    import pickle

    from prefect_aws import AwsCredentials

    from stoker.orchestration.credentials import load_block_credentials
    from stoker.storage import credentials

    key_id, secret = _fake_credentials()
    name = "stoker-aws-" + uuid.uuid4().hex[:6]
    AwsCredentials(aws_access_key_id=key_id, aws_secret_access_key=secret, aws_session_token="tok-" + secret).save(name)
    creds = load_block_credentials(f"aws-credentials/{name}")
    assert creds.fsspec_options() == {"key": key_id, "secret": secret, "token": "tok-" + secret}
    assert secret not in repr(creds) and key_id not in str(creds)
    with pytest.raises(TypeError):
        pickle.dumps(creds)
    credentials.use(creds)
    try:
        env = credentials.apply_to_env({"AWS_PROFILE": "other", "PATH": "/bin"})
        assert env == {
            "PATH": "/bin",
            "AWS_ACCESS_KEY_ID": key_id,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_SESSION_TOKEN": "tok-" + secret,
        }
        assert credentials.options_for("s3://b/x", {"endpoint_url": "http://127.0.0.1:9"})["secret"] == secret
        assert "secret" not in credentials.options_for("file:///tmp/x", {})  # only S3 URLs get them
    finally:
        credentials.use(None)
