"""Reading `terraform output -json` for `diloco launch --store-from-terraform` (issue 6).

Golden files tests/fixtures/terraform_output_{aws,gcp}.json were written by `terraform output -json`
(Terraform 1.11) for outputs shaped like infra/aws and infra/gcp; tests/infra/test_infra_contracts.py checks
that they name exactly the outputs the modules declare.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from diloco_serverless.launcher.terraform import (
    TERRAFORM_BINARY_ENV,
    TerraformOutputError,
    exchange_url_from_terraform,
    load_terraform_outputs,
    parse_terraform_outputs,
)
from support import FIXTURES

DATA = FIXTURES
AWS_GOLDEN = DATA / "terraform_output_aws.json"
GCP_GOLDEN = DATA / "terraform_output_gcp.json"


def _golden(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"terraform_output_{name}.json").read_text())


def _write(tmp_path: Path, data: Any, name: str = "outputs.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def _fake_terraform(tmp_path: Path, body: str) -> Path:
    """An executable standing in for terraform: a Python script with the given body."""
    script = tmp_path / "fake-terraform"
    script.write_text(f"#!{sys.executable}\nimport sys, json, time\n{body}\n")
    script.chmod(0o755)
    return script


def test_aws_golden_file_is_parsed_into_typed_outputs() -> None:
    out = load_terraform_outputs(AWS_GOLDEN)
    assert out.cloud == "aws"
    assert out.exchange_url == "s3://acme-diloco-exchange/diloco/"
    assert out.store_url == "s3://acme-diloco-exchange/diloco"
    assert out.bucket == "acme-diloco-exchange"
    assert out.prefix == "diloco/"
    assert out.region == "us-east-1" and out.location is None
    assert out.expiration_days == 14 and isinstance(out.expiration_days, int)
    assert out.replica_policy_arn == "arn:aws:iam::123456789012:policy/acme-diloco-exchange-diloco-replica"
    assert out.replica_role_arn == "arn:aws:iam::123456789012:role/acme-diloco-exchange-diloco-replica"
    assert out.replica_service_account is None
    assert out.source == str(AWS_GOLDEN)
    assert out.outputs["bucket_arn"] == "arn:aws:s3:::acme-diloco-exchange"
    assert out.storage_options == {"client_kwargs": {"region_name": "us-east-1"}}
    assert "us-east-1" in out.describe() and "14 days" in out.describe()


def test_gcp_golden_file_is_parsed_into_typed_outputs() -> None:
    out = load_terraform_outputs(str(GCP_GOLDEN))
    assert out.cloud == "gcp"
    assert out.exchange_url == "gs://acme-diloco-exchange/diloco/"
    assert out.location == "us-central1" and out.region is None
    assert out.replica_service_account == "diloco-replica@acme-ml-training.iam.gserviceaccount.com"
    assert out.replica_policy_arn is None
    assert out.project_id == "acme-ml-training"
    assert out.storage_options == {"project": "acme-ml-training"}


def test_exchange_url_from_terraform_returns_store_url_without_trailing_slash() -> None:
    assert exchange_url_from_terraform(AWS_GOLDEN) == "s3://acme-diloco-exchange/diloco"
    assert exchange_url_from_terraform(GCP_GOLDEN) == "gs://acme-diloco-exchange/diloco"


def test_role_arn_is_optional_because_terraform_omits_null_outputs(tmp_path: Path) -> None:
    data = _golden("aws")
    del data["replica_role_arn"]
    out = load_terraform_outputs(_write(tmp_path, data))
    assert out.replica_role_arn is None
    assert out.describe().count("policy/") == 1  # falls back to the policy as the replica identity


def test_flat_name_to_value_object_is_accepted(tmp_path: Path) -> None:
    flat = {name: entry["value"] for name, entry in _golden("gcp").items()}
    assert load_terraform_outputs(_write(tmp_path, flat)).exchange_url == "gs://acme-diloco-exchange/diloco/"


def test_sensitive_outputs_are_dropped(tmp_path: Path) -> None:
    data = _golden("aws")
    data["access_key"] = {"sensitive": True, "type": "string", "value": "AKIA-not-a-real-key"}
    out = load_terraform_outputs(_write(tmp_path, data))
    assert "access_key" not in out.outputs
    assert "AKIA" not in repr(out)


@pytest.mark.parametrize("missing", ["exchange_url", "bucket", "expiration_days", "region", "replica_policy_arn"])
def test_missing_output_is_named_with_what_to_do(tmp_path: Path, missing: str) -> None:
    data = _golden("aws")
    del data[missing]
    path = _write(tmp_path, data)
    with pytest.raises(TerraformOutputError) as err:
        load_terraform_outputs(path)
    message = str(err.value)
    assert f"lack {missing}" in message
    assert str(path) in message
    assert "terraform apply" in message and "terraform output -json" in message


def test_gcp_missing_service_account_is_named(tmp_path: Path) -> None:
    data = _golden("gcp")
    del data["replica_service_account"]
    del data["location"]
    with pytest.raises(TerraformOutputError, match="lack location, replica_service_account"):
        load_terraform_outputs(_write(tmp_path, data))


def test_empty_outputs_name_every_required_output(tmp_path: Path) -> None:
    with pytest.raises(TerraformOutputError) as err:
        load_terraform_outputs(_write(tmp_path, {}))
    message = str(err.value)
    for name in ("exchange_url", "bucket", "expiration_days", "region or location"):
        assert name in message
    assert "found: no outputs" in message


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"exchange_url": "https://acme-diloco-exchange/diloco/"}, "not an s3:// or gs:// URL"),
        ({"exchange_url": 42}, "must be a string URL"),
        ({"exchange_url": "s3://other-bucket/diloco/"}, "names bucket 'other-bucket'"),
        ({"exchange_url": "s3://acme-diloco-exchange/diloco"}, "ending with '/'"),
        ({"bucket": ""}, "bucket .* must be a non-empty string"),
        ({"expiration_days": 0}, "positive whole number"),
        ({"expiration_days": 1.5}, "positive whole number"),
        ({"expiration_days": "14"}, "positive whole number"),
        ({"expiration_days": True}, "positive whole number"),
        ({"region": 3}, "region .* must be a non-empty string"),
    ],
)
def test_malformed_outputs_are_refused(change: dict[str, Any], match: str) -> None:
    values = {name: entry["value"] for name, entry in _golden("aws").items()} | change
    with pytest.raises(TerraformOutputError, match=match):
        parse_terraform_outputs(values, source="test")


def test_integral_float_days_are_accepted() -> None:
    values = {name: entry["value"] for name, entry in _golden("aws").items()} | {"expiration_days": 7.0}
    assert parse_terraform_outputs(values, source="test").expiration_days == 7


@pytest.mark.parametrize(("content", "match"), [("not json", "not JSON"), ("[1, 2]", "got list")])
def test_unreadable_file_says_how_to_save_outputs(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "outputs.json"
    path.write_text(content)
    with pytest.raises(TerraformOutputError, match=match) as err:
        load_terraform_outputs(path)
    assert "terraform output -json > outputs.json" in str(err.value)


def test_missing_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(TerraformOutputError, match="does not exist") as err:
        load_terraform_outputs(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(err.value)


def test_directory_runs_terraform_output_json_there(tmp_path: Path) -> None:
    module = tmp_path / "module"
    module.mkdir()
    record = tmp_path / "argv.json"
    body = (
        f"json.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n"
        f"sys.stdout.write(open({str(AWS_GOLDEN)!r}).read())"
    )
    fake = _fake_terraform(tmp_path, body)
    out = load_terraform_outputs(module, terraform_bin=str(fake))
    assert out.exchange_url == "s3://acme-diloco-exchange/diloco/"
    assert json.loads(record.read_text()) == [f"-chdir={module}", "output", "-json", "-no-color"]


def test_terraform_binary_comes_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_terraform(tmp_path, f"sys.stdout.write(open({str(GCP_GOLDEN)!r}).read())")
    monkeypatch.setenv(TERRAFORM_BINARY_ENV, str(fake))
    assert exchange_url_from_terraform(tmp_path) == "gs://acme-diloco-exchange/diloco"


def test_terraform_failure_reports_its_stderr(tmp_path: Path) -> None:
    fake = _fake_terraform(tmp_path, "sys.stderr.write('Error: Backend initialization required\\n'); sys.exit(1)")
    with pytest.raises(TerraformOutputError, match="exited with 1: Error: Backend initialization required") as err:
        load_terraform_outputs(tmp_path, terraform_bin=str(fake))
    assert "terraform init" in str(err.value)


def test_terraform_timeout_is_reported(tmp_path: Path) -> None:
    fake = _fake_terraform(tmp_path, "time.sleep(60)")
    with pytest.raises(TerraformOutputError, match="did not finish within 1 s"):
        load_terraform_outputs(tmp_path, terraform_bin=str(fake), timeout_s=1.0)


def test_no_terraform_binary_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TERRAFORM_BINARY_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    with pytest.raises(TerraformOutputError, match="no `terraform` \\(or `tofu`\\) binary on PATH") as err:
        load_terraform_outputs(tmp_path)
    assert TERRAFORM_BINARY_ENV in str(err.value) and "outputs.json" in str(err.value)


# --- the real binary, where installed: outputs-only configurations need no provider -------------

_TERRAFORM = os.environ.get(TERRAFORM_BINARY_ENV) or shutil.which("terraform")
needs_terraform = pytest.mark.skipif(
    _TERRAFORM is None, reason=f"no terraform binary on PATH and {TERRAFORM_BINARY_ENV} unset"
)


def _terraform_env(tmp_path: Path) -> dict[str, str]:
    rc = tmp_path / "cli.tfrc"
    rc.write_text("")  # an empty CLI config: no credentials, no plugin cache, nothing from $HOME
    return {**os.environ, "TF_CLI_CONFIG_FILE": str(rc), "TF_IN_AUTOMATION": "1", "CHECKPOINT_DISABLE": "1"}


@needs_terraform
def test_real_terraform_apply_then_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = tmp_path / "module"
    module.mkdir()
    lines = [
        f"output {json.dumps(name)} {{\n  value = {json.dumps(entry['value'])}\n}}\n"
        for name, entry in _golden("aws").items()
        if name != "replica_role_arn"
    ]
    (module / "outputs.tf").write_text("".join(lines) + 'output "replica_role_arn" {\n  value = null\n}\n')
    env = _terraform_env(tmp_path)
    for args in (["init", "-input=false"], ["apply", "-auto-approve", "-input=false"]):
        subprocess.run([_TERRAFORM, f"-chdir={module}", *args], env=env, check=True, capture_output=True, timeout=120)
    for key in ("TF_CLI_CONFIG_FILE", "TF_IN_AUTOMATION", "CHECKPOINT_DISABLE"):
        monkeypatch.setenv(key, env[key])
    out = load_terraform_outputs(module, terraform_bin=_TERRAFORM)
    assert out.exchange_url == "s3://acme-diloco-exchange/diloco/"
    assert out.expiration_days == 14
    assert out.replica_role_arn is None


@needs_terraform
def test_real_terraform_without_state_names_missing_outputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = tmp_path / "never-applied"
    module.mkdir()
    monkeypatch.setenv("TF_CLI_CONFIG_FILE", _terraform_env(tmp_path)["TF_CLI_CONFIG_FILE"])
    with pytest.raises(TerraformOutputError, match="lack exchange_url") as err:
        load_terraform_outputs(module, terraform_bin=_TERRAFORM)
    assert "terraform apply" in str(err.value)
