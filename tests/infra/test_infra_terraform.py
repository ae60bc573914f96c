"""`terraform fmt -check`, `terraform validate` and `terraform test` on infra/aws and infra/gcp (issue 6).

Needs a terraform binary (PATH or $DILOCO_TERRAFORM) and, for validate/test, the provider in a local
mirror ($DILOCO_TF_PROVIDER_MIRROR, else a few usual places, in the unpacked layout
<mirror>/registry.terraform.io/hashicorp/<aws|google>/<version>/<os_arch>/). The test writes a CLI
config that installs providers from that mirror only, so nothing is downloaded; each module is copied
to a temporary directory so `.terraform/` and the lock file never land in the repository. Skips with
the reason when the binary or the provider is absent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import REPO_ROOT

pytestmark = pytest.mark.slow  # terraform init + test: tens of seconds per module

ROOT = REPO_ROOT
INFRA = ROOT / "infra"
PROVIDERS = {"aws": "aws", "gcp": "google"}
_MIRROR_CANDIDATES = (
    "/opt/tf-plugins",
    "~/.terraform.d/plugins",
    "~/.local/share/terraform/plugins",
    "/usr/local/share/terraform/plugins",
    "/usr/share/terraform/plugins",
)


def _terraform() -> str | None:
    return os.environ.get("DILOCO_TERRAFORM") or shutil.which("terraform")


def _mirror_with(provider: str) -> Path | None:
    """The first mirror directory holding hashicorp/<provider> in the unpacked layout."""
    env = os.environ.get("DILOCO_TF_PROVIDER_MIRROR")
    candidates = [env] if env else list(_MIRROR_CANDIDATES)
    for candidate in candidates:
        mirror = Path(candidate).expanduser()
        if any((mirror / "registry.terraform.io" / "hashicorp" / provider).glob("*/*/terraform-provider-*")):
            return mirror
    return None


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)


def _report(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def terraform_bin() -> str:
    binary = _terraform()
    if binary is None:
        pytest.skip("no terraform binary: not on PATH and DILOCO_TERRAFORM unset (it cannot be downloaded in CI)")
    return binary


def _base_env(config: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TF_", "AWS_", "GOOGLE_"))}
    env.update(TF_CLI_CONFIG_FILE=str(config), TF_IN_AUTOMATION="1", CHECKPOINT_DISABLE="1")
    return env


def test_terraform_fmt_check(terraform_bin: str, tmp_path: Path) -> None:
    config = tmp_path / "empty.tfrc"
    config.write_text("")
    args = [terraform_bin, "fmt", "-check", "-recursive", "-diff", "-no-color", str(INFRA)]
    proc = _run(args, ROOT, _base_env(config))
    assert proc.returncode == 0, f"run `terraform fmt -recursive infra`:\n{_report(proc)}"


@pytest.fixture(scope="module", params=sorted(PROVIDERS))
def initialised_module(
    request: pytest.FixtureRequest, terraform_bin: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path, dict[str, str]]]:
    """A copy of infra/<cloud> after `terraform init` against the local provider mirror."""
    cloud: str = request.param
    provider = PROVIDERS[cloud]
    mirror = _mirror_with(provider)
    if mirror is None:
        where = os.environ.get("DILOCO_TF_PROVIDER_MIRROR") or ", ".join(_MIRROR_CANDIDATES)
        pytest.skip(
            f"provider hashicorp/{provider} not in a local mirror ({where}); set DILOCO_TF_PROVIDER_MIRROR "
            f"to a directory with registry.terraform.io/hashicorp/{provider}/<version>/<os_arch>/"
        )
    work = tmp_path_factory.mktemp(f"tf-{cloud}")
    config = work / "cli.tfrc"
    config.write_text(
        "provider_installation {\n"
        "  filesystem_mirror {\n"
        f"    path    = \"{mirror}\"\n"
        "    include = [\"registry.terraform.io/hashicorp/*\"]\n"
        "  }\n"
        "}\n"
    )
    module = work / cloud
    ignore = shutil.ignore_patterns(".terraform", ".terraform.lock.hcl", "*.tfstate*")
    shutil.copytree(INFRA / cloud, module, ignore=ignore)
    env = _base_env(config)
    proc = _run([terraform_bin, "init", "-input=false", "-backend=false", "-no-color"], module, env)
    assert proc.returncode == 0, f"terraform init for infra/{cloud} from mirror {mirror} failed:\n{_report(proc)}"
    yield cloud, module, env


def test_terraform_validate(terraform_bin: str, initialised_module: tuple[str, Path, dict[str, str]]) -> None:
    cloud, module, env = initialised_module
    proc = _run([terraform_bin, "validate", "-no-color"], module, env)
    assert proc.returncode == 0, f"terraform validate infra/{cloud}:\n{_report(proc)}"


def test_terraform_test_with_mock_provider(
    terraform_bin: str, initialised_module: tuple[str, Path, dict[str, str]]
) -> None:
    cloud, module, env = initialised_module
    proc = _run([terraform_bin, "test", "-no-color"], module, env, timeout_s=600.0)
    assert proc.returncode == 0, f"terraform test infra/{cloud}:\n{_report(proc)}"
    assert " 0 failed" in proc.stdout and "Success!" in proc.stdout, _report(proc)
    assert "skip" not in proc.stdout.replace("skipped", ""), f"a run was skipped:\n{_report(proc)}"
