"""Read the outputs of the exchange-bucket Terraform modules (``infra/aws``, ``infra/gcp``).

Users provision the bucket the replicas share with Terraform, then launch against it::

    terraform -chdir=infra/aws apply
    diloco launch --store-from-terraform infra/aws       # runs `terraform output -json` there
    terraform -chdir=infra/aws output -json > outputs.json
    diloco launch --store-from-terraform outputs.json    # or reads a saved copy

`load_terraform_outputs` returns a typed `TerraformOutputs`; `exchange_url_from_terraform` returns
just the store URL. Both raise `TerraformOutputError` with a message that names the directory or file,
the missing or malformed outputs, and what to run to fix it. Nothing here needs cloud credentials
unless the module's Terraform backend does; sensitive outputs are never kept.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from diloco_serverless.errors import DilocoError

__all__ = [
    "REQUIRED_OUTPUTS",
    "TERRAFORM_BINARY_ENV",
    "TerraformOutputError",
    "TerraformOutputs",
    "exchange_url_from_terraform",
    "load_terraform_outputs",
    "parse_terraform_outputs",
    "read_terraform_output_json",
]

TERRAFORM_BINARY_ENV = "DILOCO_TERRAFORM"
"""Environment variable naming the terraform (or OpenTofu) binary; else `terraform`, then `tofu` on PATH."""

Cloud = Literal["aws", "gcp"]
_SCHEMES: dict[str, Cloud] = {"s3": "aws", "gs": "gcp"}
_COMMON_OUTPUTS = ("exchange_url", "bucket", "expiration_days")
_CLOUD_OUTPUTS: dict[Cloud, tuple[str, ...]] = {
    "aws": ("region", "replica_policy_arn"),
    "gcp": ("location", "replica_service_account"),
}
REQUIRED_OUTPUTS: dict[Cloud, tuple[str, ...]] = {
    cloud: _COMMON_OUTPUTS + extra for cloud, extra in _CLOUD_OUTPUTS.items()
}
"""The outputs `load_terraform_outputs` insists on, per cloud (infra/<cloud>/outputs.tf declares them)."""
_MODULE_HINT = "the outputs of infra/aws or infra/gcp from diloco-serverless"
_FIX_HINT = (
    "run `terraform apply` in the module directory (infra/aws or infra/gcp) first, "
    "or pass a file saved with `terraform output -json > outputs.json`"
)


class TerraformOutputError(DilocoError, RuntimeError):
    """Terraform outputs could not be read or lack what `diloco launch` needs; the message says what to do."""


@dataclass(frozen=True)
class TerraformOutputs:
    """What the exchange-bucket modules output, typed.

    ``exchange_url`` is the output verbatim (``s3://bucket/prefix/``, trailing slash);
    ``store_url`` is the same URL without the trailing slash, as `ObjectStore` and
    ``RunConfig.store`` use it. AWS modules set ``region`` and ``replica_policy_arn``
    (``replica_role_arn`` when a role was created); GCP modules set ``location``,
    ``replica_service_account`` and ``project_id``.
    """

    exchange_url: str
    bucket: str
    cloud: Cloud
    expiration_days: int
    source: str
    prefix: str | None = None
    region: str | None = None
    location: str | None = None
    replica_policy_arn: str | None = None
    replica_role_arn: str | None = None
    replica_service_account: str | None = None
    project_id: str | None = None
    outputs: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """Every non-sensitive output value, by name (including ones this class does not model)."""
    @property
    def store_url(self) -> str:
        """The exchange URL without its trailing slash, e.g. ``s3://bucket/diloco``."""
        return self.exchange_url.rstrip("/")

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec options that point replicas at the bucket's region/project (no credentials)."""
        if self.cloud == "aws" and self.region:
            return {"client_kwargs": {"region_name": self.region}}
        if self.cloud == "gcp" and self.project_id:
            return {"project": self.project_id}
        return {}

    def describe(self) -> str:
        """One line for the CLI: URL, cloud, place, expiry and the replica identity."""
        place = self.region if self.cloud == "aws" else self.location
        identity = self.replica_role_arn or self.replica_policy_arn or self.replica_service_account
        return (
            f"{self.exchange_url} ({self.cloud} {place}; objects expire after "
            f"{self.expiration_days} days; replica identity {identity}; from {self.source})"
        )


def exchange_url_from_terraform(path: str | Path) -> str:
    """The store URL (no trailing slash) from a module directory or a saved `terraform output -json` file.

    Raises `TerraformOutputError` when the outputs cannot be read or lack ``exchange_url`` and the
    other outputs the CLI reads.
    """
    return load_terraform_outputs(path).store_url


def load_terraform_outputs(
    path: str | Path, *, terraform_bin: str | None = None, timeout_s: float = 120.0
) -> TerraformOutputs:
    """Read and validate the outputs of ``path``: a module directory, or a saved JSON file.

    A directory is read by running ``terraform output -json`` in it (binary: ``terraform_bin``,
    ``$DILOCO_TERRAFORM``, then ``terraform`` or ``tofu`` on PATH). A file must hold that command's
    JSON (or a flat ``{name: value}`` object). Raises `TerraformOutputError` naming the path and
    what to do when the path is missing, terraform fails, or outputs are missing or malformed.
    """
    source = str(path)
    values = read_terraform_output_json(path, terraform_bin=terraform_bin, timeout_s=timeout_s)
    return parse_terraform_outputs(values, source=source)


def read_terraform_output_json(
    path: str | Path, *, terraform_bin: str | None = None, timeout_s: float = 120.0
) -> dict[str, Any]:
    """Non-sensitive output values by name, from a directory (runs terraform) or a JSON file."""
    p = Path(path).expanduser()
    if p.is_dir():
        text = _run_terraform_output(p, terraform_bin=terraform_bin, timeout_s=timeout_s)
    elif p.is_file():
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TerraformOutputError(f"cannot read Terraform outputs file {p}: {e}") from e
    else:
        raise TerraformOutputError(
            f"{p} does not exist: pass the Terraform module directory where you ran `terraform apply` "
            "(e.g. infra/aws) or a file saved with `terraform output -json > outputs.json`"
        )
    return _output_values(text, source=str(p))


def parse_terraform_outputs(values: Mapping[str, Any], *, source: str) -> TerraformOutputs:
    """Validate output values (already unwrapped from `terraform output -json`) into `TerraformOutputs`."""
    url = values.get("exchange_url")
    cloud = _cloud_of(url, values)
    required = REQUIRED_OUTPUTS[cloud] if cloud else _COMMON_OUTPUTS
    missing = [name for name in required if values.get(name) is None]
    if cloud is None:
        missing.append("region or location (AWS: region, replica_policy_arn; GCP: location, replica_service_account)")
    if missing:
        raise TerraformOutputError(
            f"Terraform outputs from {source} lack {', '.join(missing)} (found: "
            f"{', '.join(sorted(values)) or 'no outputs'}); these must be {_MODULE_HINT}: {_FIX_HINT}"
        )
    assert cloud is not None and isinstance(url, str)
    bucket = _string(values, "bucket", source)
    _check_url(url, bucket, source)
    return TerraformOutputs(
        exchange_url=url,
        bucket=bucket,
        cloud=cloud,
        expiration_days=_positive_days(values["expiration_days"], source),
        source=source,
        prefix=_optional_string(values, "prefix", source),
        region=_optional_string(values, "region", source),
        location=_optional_string(values, "location", source),
        replica_policy_arn=_optional_string(values, "replica_policy_arn", source),
        replica_role_arn=_optional_string(values, "replica_role_arn", source),
        replica_service_account=_optional_string(values, "replica_service_account", source),
        project_id=_optional_string(values, "project_id", source),
        outputs=dict(values),
    )


def _terraform_binary(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    env = os.environ.get(TERRAFORM_BINARY_ENV)
    if env:
        return env
    return shutil.which("terraform") or shutil.which("tofu")


def _run_terraform_output(directory: Path, *, terraform_bin: str | None, timeout_s: float) -> str:
    """stdout of `terraform output -json` in ``directory``; TerraformOutputError on any failure."""
    binary = _terraform_binary(terraform_bin)
    if binary is None:
        raise TerraformOutputError(
            f"cannot read the Terraform outputs of {directory}: no `terraform` (or `tofu`) binary on PATH. "
            f"Install Terraform, set {TERRAFORM_BINARY_ENV} to its path, or run "
            f"`terraform -chdir={directory} output -json > outputs.json` where Terraform is installed "
            "and pass outputs.json instead"
        )
    cmd = [binary, f"-chdir={directory}", "output", "-json", "-no-color"]
    env = {**os.environ, "TF_IN_AUTOMATION": "1", "CHECKPOINT_DISABLE": "1"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    except subprocess.TimeoutExpired as e:
        raise TerraformOutputError(
            f"`{' '.join(cmd)}` did not finish within {timeout_s:.0f} s (a remote backend that is unreachable "
            "or waiting for a lock?); check the backend, or pass a saved `terraform output -json` file"
        ) from e
    except OSError as e:
        raise TerraformOutputError(f"cannot run {binary!r} for {directory}: {e}; set {TERRAFORM_BINARY_ENV}") from e
    if proc.returncode != 0:
        detail = " ".join(proc.stderr.strip().split())[-600:] or "no error output"
        raise TerraformOutputError(
            f"`{' '.join(cmd)}` exited with {proc.returncode}: {detail}. Run `terraform init` and "
            f"`terraform apply` in {directory} first, or pass a saved `terraform output -json` file"
        )
    return proc.stdout


def _output_values(text: str, *, source: str) -> dict[str, Any]:
    """Unwrap `terraform output -json` ({name: {value, type, sensitive}}) or accept a flat object."""
    try:
        data = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise TerraformOutputError(
            f"Terraform outputs from {source} are not JSON ({e}); save them with "
            "`terraform output -json > outputs.json` (note the -json)"
        ) from e
    if not isinstance(data, dict):
        raise TerraformOutputError(
            f"Terraform outputs from {source} must be a JSON object of outputs, got {type(data).__name__}; "
            "save them with `terraform output -json > outputs.json`"
        )
    wrapped = bool(data) and all(isinstance(v, dict) and "value" in v for v in data.values())
    if not wrapped:
        return dict(data)
    return {name: entry["value"] for name, entry in data.items() if not entry.get("sensitive", False)}


def _cloud_of(url: Any, values: Mapping[str, Any]) -> Cloud | None:
    if isinstance(url, str):
        scheme = urlsplit(url).scheme
        if scheme not in _SCHEMES:
            raise TerraformOutputError(
                f"exchange_url {url!r} is not an s3:// or gs:// URL; expected {_MODULE_HINT}"
            )
        return _SCHEMES[scheme]
    if url is not None:
        raise TerraformOutputError(f"exchange_url must be a string URL, got {type(url).__name__}")
    if "replica_policy_arn" in values or "region" in values:
        return "aws"
    if "replica_service_account" in values or "location" in values:
        return "gcp"
    return None


def _check_url(url: str, bucket: str, source: str) -> None:
    parts = urlsplit(url)
    if parts.netloc != bucket:
        raise TerraformOutputError(
            f"exchange_url {url!r} from {source} names bucket {parts.netloc!r} but the bucket output is "
            f"{bucket!r}; re-run `terraform apply` so the outputs agree"
        )
    if not url.endswith("/") or parts.query or parts.fragment:
        raise TerraformOutputError(
            f"exchange_url {url!r} from {source} must be <scheme>://<bucket>/<prefix>/ ending with '/'; "
            f"expected {_MODULE_HINT}"
        )


def _string(values: Mapping[str, Any], name: str, source: str) -> str:
    value = values.get(name)
    if not isinstance(value, str) or not value:
        raise TerraformOutputError(f"output {name} from {source} must be a non-empty string, got {value!r}")
    return value


def _optional_string(values: Mapping[str, Any], name: str, source: str) -> str | None:
    return None if values.get(name) is None else _string(values, name, source)


def _positive_days(value: Any, source: str) -> int:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and float(value).is_integer()
    if not ok:
        raise TerraformOutputError(
            f"output expiration_days from {source} must be a positive whole number of days, got {value!r}"
        )
    return int(value)
