"""Contract tests for infra/aws and infra/gcp (issue 6), read with python-hcl2: no Terraform needed.

They pin the security properties a reviewer would check by eye (public access fully blocked,
encryption, TLS-only, lifecycle expiry, least-privilege IAM limited to the prefix) and the outputs
`diloco launch --store-from-terraform` reads. Expressions are compared as the source text python-hcl2
returns (``${var.prefix}``); validation regexes are lifted out and exercised with Python's `re`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hcl2
import pytest

from diloco_serverless.launcher.terraform import REQUIRED_OUTPUTS
from support import FIXTURES, REPO_ROOT

ROOT = REPO_ROOT
INFRA = ROOT / "infra"
DATA = FIXTURES
# python-hcl2 >= 8 keeps string quotes unless told otherwise; older releases strip them already.
_OPTIONS = (
    hcl2.SerializationOptions(strip_string_quotes=True, explicit_blocks=False, with_comments=False)
    if hasattr(hcl2, "SerializationOptions")
    else None
)
_ROOT_MODULE_FILES = (
    "versions.tf", "variables.tf", "main.tf", "iam.tf", "outputs.tf", "terraform.tfvars.example", "README.md",
)


def _parse(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        return hcl2.load(f) if _OPTIONS is None else hcl2.load(f, serialization_options=_OPTIONS)


def _load_module(cloud: str) -> dict[str, Any]:
    """Every top-level block of infra/<cloud>/*.tf, keyed like Terraform addresses."""
    module: dict[str, Any] = {"resource": {}, "data": {}, "variable": {}, "output": {}, "locals": {}}
    for path in sorted((INFRA / cloud).glob("*.tf")):
        parsed = _parse(path)
        for kind in ("resource", "data"):
            for block in parsed.get(kind, []):
                for type_, named in block.items():
                    for name, body in named.items():
                        module[kind].setdefault(type_, {})[name] = body
        for kind in ("variable", "output"):
            for block in parsed.get(kind, []):
                module[kind].update(block)
        for block in parsed.get("locals", []):
            module["locals"].update(block)
    return module


@pytest.fixture(scope="module")
def aws() -> dict[str, Any]:
    return _load_module("aws")


@pytest.fixture(scope="module")
def gcp() -> dict[str, Any]:
    return _load_module("gcp")


def _only(module: dict[str, Any], kind: str, type_: str) -> dict[str, Any]:
    blocks = module[kind].get(type_, {})
    assert len(blocks) == 1, f"expected exactly one {kind} {type_}, found {sorted(blocks)}"
    return next(iter(blocks.values()))


def _block(body: dict[str, Any], name: str) -> dict[str, Any]:
    blocks = body.get(name, [])
    assert len(blocks) == 1, f"expected one {name} block, found {blocks!r}"
    return blocks[0]


def _validation_regex(variable: dict[str, Any], subject: str) -> re.Pattern[str]:
    """The first `regex("...", <subject>)` in the variable's validation, compiled with Python's re."""
    conditions = " ".join(v["condition"] for v in variable["validation"])
    match = re.search(r'regex\("((?:[^"\\]|\\.)*)", ' + re.escape(subject) + r"\)", conditions)
    assert match, f"no regex() on {subject} in {conditions}"
    return re.compile(json.loads(f'"{match.group(1)}"'))  # HCL and JSON string escapes agree here


def _all_strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _all_strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _all_strings(value)


# --- both modules ------------------------------------------------------------------------------


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_module_has_the_standard_layout(cloud: str) -> None:
    for name in _ROOT_MODULE_FILES:
        assert (INFRA / cloud / name).is_file(), f"infra/{cloud}/{name} is missing"
    tftests = list((INFRA / cloud / "tests").glob("*.tftest.hcl"))
    assert tftests, f"infra/{cloud}/tests has no *.tftest.hcl"
    assert (INFRA / "README.md").is_file()


@pytest.mark.parametrize(("cloud", "provider"), [("aws", "hashicorp/aws"), ("gcp", "hashicorp/google")])
def test_versions_pin_terraform_and_provider(cloud: str, provider: str) -> None:
    terraform = _parse(INFRA / cloud / "versions.tf")["terraform"][0]
    assert terraform["required_version"] == ">= 1.7.0"  # mock_provider in `terraform test`
    (providers,) = terraform["required_providers"]
    (spec,) = providers.values()
    assert spec["source"] == provider
    assert "<" in spec["version"] and ">=" in spec["version"], "bound the provider's major version"


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_outputs_the_cli_reads_are_declared(cloud: str, aws: dict[str, Any], gcp: dict[str, Any]) -> None:
    module = aws if cloud == "aws" else gcp
    assert set(REQUIRED_OUTPUTS[cloud]) <= set(module["output"])
    scheme = "s3" if cloud == "aws" else "gs"
    bucket_ref = "aws_s3_bucket.exchange.bucket" if cloud == "aws" else "google_storage_bucket.exchange.name"
    assert module["output"]["exchange_url"]["value"] == f"{scheme}://${{{bucket_ref}}}/${{var.prefix}}"
    assert module["output"]["expiration_days"]["value"] == "${var.expiration_days}"
    for name, output in module["output"].items():
        assert output.get("description"), f"output {name} needs a description"


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_golden_output_file_matches_the_module(cloud: str, aws: dict[str, Any], gcp: dict[str, Any]) -> None:
    module = aws if cloud == "aws" else gcp
    golden = json.loads((DATA / f"terraform_output_{cloud}.json").read_text())
    assert set(golden) == set(module["output"]), "regenerate tests/fixtures/terraform_output_<cloud>.json"
    assert all(set(entry) == {"sensitive", "type", "value"} for entry in golden.values())


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_variables_are_validated(cloud: str, aws: dict[str, Any], gcp: dict[str, Any]) -> None:
    variables = (aws if cloud == "aws" else gcp)["variable"]
    prefix = _validation_regex(variables["prefix"], "var.prefix")
    for good in ("diloco/", "team-a/diloco/", "runs_2026.v1/"):
        assert prefix.fullmatch(good), good
    for bad in ("diloco", "/diloco/", "runs/*/", "a//", "", "diloco/ "):
        assert not prefix.fullmatch(bad), bad
    bucket = _validation_regex(variables["bucket_name"], "var.bucket_name")
    for good in ("acme-diloco-exchange", "abc", "a1.b2"):
        assert bucket.fullmatch(good), good
    for bad in ("ab", "Acme", "-acme", "acme-", "a" * 64, "acme bucket"):
        assert not bucket.fullmatch(bad), bad
    days = variables["expiration_days"]
    assert days["type"] == "number" and days["default"] > 0
    assert "var.expiration_days > 0" in days["validation"][0]["condition"]
    assert "floor(var.expiration_days) == var.expiration_days" in days["validation"][0]["condition"]
    assert variables["force_destroy"]["default"] is False
    for name, variable in variables.items():
        assert variable.get("description"), f"variable {name} needs a description"


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_no_long_lived_credentials_in_state(cloud: str, aws: dict[str, Any], gcp: dict[str, Any]) -> None:
    resources = (aws if cloud == "aws" else gcp)["resource"]
    for forbidden in ("aws_iam_access_key", "aws_iam_user", "google_service_account_key"):
        assert forbidden not in resources, f"{forbidden} would put a secret in Terraform state"


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_tftest_covers_plan_apply_and_invalid_variables(cloud: str) -> None:
    provider = "aws" if cloud == "aws" else "google"
    for path in (INFRA / cloud / "tests").glob("*.tftest.hcl"):
        parsed = _parse(path)
        assert provider in parsed["mock_provider"][0]
        runs = {name: body for run in parsed["run"] for name, body in run.items()}
        commands = {body.get("command", "apply") for body in runs.values()}
        assert {"plan", "apply"} <= commands
        expected = {f for body in runs.values() for f in body.get("expect_failures", [])}
        assert {"${var.prefix}", "${var.expiration_days}", "${var.bucket_name}"} <= expected


# --- AWS ---------------------------------------------------------------------------------------


def test_aws_public_access_fully_blocked(aws: dict[str, Any]) -> None:
    block = _only(aws, "resource", "aws_s3_bucket_public_access_block")
    assert block["bucket"] == "${aws_s3_bucket.exchange.id}"
    for setting in ("block_public_acls", "block_public_policy", "ignore_public_acls", "restrict_public_buckets"):
        assert block[setting] is True, setting


def test_aws_bucket_owner_enforced_and_force_destroy_variable(aws: dict[str, Any]) -> None:
    bucket = _only(aws, "resource", "aws_s3_bucket")
    assert bucket["force_destroy"] == "${var.force_destroy}"
    ownership = _only(aws, "resource", "aws_s3_bucket_ownership_controls")
    assert _block(ownership, "rule")["object_ownership"] == "BucketOwnerEnforced"
    assert "aws_s3_bucket_acl" not in aws["resource"]


def test_aws_encryption_on(aws: dict[str, Any]) -> None:
    sse = _only(aws, "resource", "aws_s3_bucket_server_side_encryption_configuration")
    default = _block(_block(sse, "rule"), "apply_server_side_encryption_by_default")
    assert default["sse_algorithm"] == "${local.sse_algorithm}"
    assert aws["locals"]["sse_algorithm"] == '${var.kms_key_arn == null ? "AES256" : "aws:kms"}'


def test_aws_bucket_policy_denies_insecure_transport(aws: dict[str, Any]) -> None:
    policy = _only(aws, "resource", "aws_s3_bucket_policy")
    assert policy["policy"] == "${data.aws_iam_policy_document.tls_only.json}"
    statements = aws["data"]["aws_iam_policy_document"]["tls_only"]["statement"]
    insecure = [s for s in statements if _block(s, "condition")["variable"] == "aws:SecureTransport"]
    assert len(insecure) == 1
    (deny,) = insecure
    assert deny["effect"] == "Deny" and deny["actions"] == ["s3:*"]
    assert _block(deny, "principals") == {"type": "*", "identifiers": ["*"]}
    assert _block(deny, "condition") == {"test": "Bool", "variable": "aws:SecureTransport", "values": ["false"]}
    assert deny["resources"] == ["${aws_s3_bucket.exchange.arn}", "${aws_s3_bucket.exchange.arn}/*"]
    assert all(s["effect"] == "Deny" for s in statements), "the bucket policy only denies"


def test_aws_lifecycle_expires_prefix_and_aborts_multipart(aws: dict[str, Any]) -> None:
    rules = _only(aws, "resource", "aws_s3_bucket_lifecycle_configuration")["rule"]
    expiring = [r for r in rules if "expiration" in r]
    assert len(expiring) == 1
    assert expiring[0]["status"] == "Enabled"
    assert _block(expiring[0], "filter") == {"prefix": "${var.prefix}"}
    assert _block(expiring[0], "expiration") == {"days": "${var.expiration_days}"}
    aborting = [r for r in rules if "abort_incomplete_multipart_upload" in r]
    assert len(aborting) == 1
    assert aborting[0]["status"] == "Enabled"
    assert _block(aborting[0], "filter") == {}, "the multipart rule must cover the whole bucket"
    days = _block(aborting[0], "abort_incomplete_multipart_upload")["days_after_initiation"]
    assert days == "${var.abort_incomplete_multipart_days}"


def test_aws_replica_policy_is_limited_to_prefix_and_actions(aws: dict[str, Any]) -> None:
    policy = aws["resource"]["aws_iam_policy"]["replica"]
    assert policy["policy"] == "${data.aws_iam_policy_document.replica.json}"
    statements = aws["data"]["aws_iam_policy_document"]["replica"]["statement"]
    assert all(s["effect"] == "Allow" and "not_actions" not in s and "not_resources" not in s for s in statements)
    actions = sorted(a for s in statements for a in s["actions"])
    assert actions == ["s3:AbortMultipartUpload", "s3:DeleteObject", "s3:GetObject", "s3:ListBucket", "s3:PutObject"]
    by_action = {a: s for s in statements for a in s["actions"]}
    listing = by_action["s3:ListBucket"]
    assert listing["actions"] == ["s3:ListBucket"]
    assert listing["resources"] == ["${aws_s3_bucket.exchange.arn}"]
    assert _block(listing, "condition")["variable"] == "s3:prefix"
    assert all(v.startswith("${var.prefix}") for v in _block(listing, "condition")["values"])
    for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"):
        (resource,) = by_action[action]["resources"]
        assert resource.startswith("${aws_s3_bucket.exchange.arn}/${var.prefix}"), action
        assert "condition" not in by_action[action]


def test_aws_optional_role_trusts_only_the_variable(aws: dict[str, Any]) -> None:
    role = aws["resource"]["aws_iam_role"]["replica"]
    assert role["count"] == "${local.create_replica_role ? 1 : 0}"
    assert aws["locals"]["create_replica_role"] == "${length(var.replica_role_trusted_principals) > 0}"
    assert aws["variable"]["replica_role_trusted_principals"]["default"] == []
    statements = aws["data"]["aws_iam_policy_document"]["replica_trust"]["statement"]
    assert {a for s in statements for a in s["actions"]} == {"sts:AssumeRole", "sts:TagSession"}
    for trust in statements:
        assert trust["effect"] == "Allow"
        assert _block(trust, "principals") == {"type": "AWS", "identifiers": "${var.replica_role_trusted_principals}"}
    attachment = aws["resource"]["aws_iam_role_policy_attachment"]["replica"]
    assert attachment["policy_arn"] == "${aws_iam_policy.replica.arn}"
    principal = _validation_regex(aws["variable"]["replica_role_trusted_principals"], "p")
    assert principal.fullmatch("arn:aws:iam::123456789012:role/runner")
    assert not principal.fullmatch("*") and not principal.fullmatch("arn:aws:iam::*:root")


# The IAM policy variable for the run tag, as written in HCL ($$ keeps Terraform from interpolating it).
RUN_TAG_VARIABLE = "$${aws:PrincipalTag/diloco-run-id}"
RUN_OBJECT_ACTIONS = ["s3:AbortMultipartUpload", "s3:DeleteObject", "s3:GetObject", "s3:PutObject"]


def _conditions(statement: dict[str, Any]) -> list[dict[str, Any]]:
    assert "dynamic" not in statement, "a condition that can be switched off is no requirement"
    return list(statement.get("condition", []))


def _numeric_validation_accepts(variable: dict[str, Any], name: str, value: float) -> bool:
    """Evaluate a validation made of comparisons, `&&`, `||` and floor() on one number, with Python."""
    results = []
    for validation in variable["validation"]:
        expression = validation["condition"].removeprefix("${").removesuffix("}")
        assert re.fullmatch(r"[\w.\s<>=!&|()]+", expression), expression
        python = expression.replace("&&", " and ").replace("||", " or ").replace(name, repr(value))
        results.append(bool(eval(python, {"__builtins__": {}, "floor": math.floor})))  # noqa: S307
    return all(results)


def test_aws_replica_policy_is_scoped_to_one_run_by_the_session_tag(aws: dict[str, Any]) -> None:
    """Every replica grant names <prefix><run tag>/: a session of run A reaches nothing of run B."""
    statements = aws["data"]["aws_iam_policy_document"]["replica"]["statement"]
    by_action = {a: s for s in statements for a in s["actions"]}
    listing = by_action["s3:ListBucket"]
    assert _conditions(listing) == [
        {"test": "StringLike", "variable": "s3:prefix", "values": [f"${{var.prefix}}{RUN_TAG_VARIABLE}/*"]}
    ]
    run_objects = f"${{aws_s3_bucket.exchange.arn}}/${{var.prefix}}{RUN_TAG_VARIABLE}/*"
    for action in RUN_OBJECT_ACTIONS:
        assert by_action[action]["resources"] == [run_objects], action
    # Nothing in the replica policy reaches the whole prefix any more.
    assert not [v for v in _all_strings(statements) if v.endswith("${var.prefix}*")]
    # A tag on the role itself would stand in for a missing session tag: default_tags may not carry it.
    tags = aws["variable"]["tags"]
    assert "diloco-run-id" not in {k.lower() for k in tags["default"]}
    assert any(
        'lower(k)], "diloco-run-id")' in v["condition"] and v["condition"].startswith("${!contains(")
        for v in tags["validation"]
    )
    assert aws["output"]["run_tag_key"]["value"] == "${local.run_tag_key}"
    assert aws["locals"]["run_tag_key"] == "diloco-run-id"


def test_aws_session_policy_template_restricts_to_one_run(aws: dict[str, Any]) -> None:
    """The JSON a launcher passes as --policy: the replica's actions, on <prefix>{{run_id}}/ only."""
    assert aws["output"]["replica_session_policy_template"]["value"] == "${jsonencode(local.replica_session_policy)}"
    policy = aws["locals"]["replica_session_policy"]
    assert policy["Version"] == "2012-10-17"
    statements = policy["Statement"]
    assert all(set(s) <= {"Sid", "Effect", "Action", "Resource", "Condition"} for s in statements)
    assert all(s["Effect"] == "Allow" for s in statements)
    (listing,) = [s for s in statements if "s3:ListBucket" in s["Action"]]
    assert listing["Action"] == ["s3:ListBucket"]
    assert listing["Resource"] == ["${aws_s3_bucket.exchange.arn}"]
    assert listing["Condition"] == {"StringLike": {"s3:prefix": ["${var.prefix}{{run_id}}/*"]}}
    (objects,) = [s for s in statements if s is not listing]
    assert sorted(objects["Action"]) == RUN_OBJECT_ACTIONS
    assert objects["Resource"] == ["${aws_s3_bucket.exchange.arn}/${var.prefix}{{run_id}}/*"]
    assert "Condition" not in objects


def test_aws_trust_policy_requires_external_id_and_the_run_tag(aws: dict[str, Any]) -> None:
    """AssumeRole needs sts:ExternalId (for any trusted principal, cross-account included) and the
    run tag; sts:TagSession is allowed for the diloco-run-id key only."""
    statements = aws["data"]["aws_iam_policy_document"]["replica_trust"]["statement"]
    (assume,) = [s for s in statements if s["actions"] == ["sts:AssumeRole"]]
    (tag,) = [s for s in statements if s["actions"] == ["sts:TagSession"]]
    assert len(statements) == 2
    assert _conditions(assume) == [
        {"test": "StringEquals", "variable": "sts:ExternalId", "values": ["${var.replica_role_external_id}"]},
        {"test": "StringLike", "variable": "aws:RequestTag/diloco-run-id", "values": ["?*"]},
    ]
    assert _conditions(tag) == [
        {"test": "ForAllValues:StringEquals", "variable": "aws:TagKeys", "values": ["diloco-run-id"]},
        {"test": "StringLike", "variable": "aws:RequestTag/diloco-run-id", "values": ["?*"]},
        {"test": "StringNotLike", "variable": "aws:RequestTag/diloco-run-id", "values": ["*/*"]},
        {"test": "ForAllValues:StringEquals", "variable": "sts:TransitiveTagKeys", "values": ["diloco-run-id"]},
    ]
    # A role with trusted principals and no ExternalId does not plan.
    trust = aws["data"]["aws_iam_policy_document"]["replica_trust"]
    preconditions = [c["condition"] for block in trust["lifecycle"] for c in block["precondition"]]
    assert "${var.replica_role_external_id != null}" in preconditions
    assert any(":role/${local.replica_role_name}" in c for c in preconditions), "the role must not trust itself"
    external_id = aws["variable"]["replica_role_external_id"]
    assert external_id["default"] is None and external_id["sensitive"] is True
    (validation,) = external_id["validation"]
    assert 'length(coalesce(var.replica_role_external_id, "unset")) >= 16' in validation["condition"]


def test_aws_sessions_default_to_one_hour(aws: dict[str, Any]) -> None:
    variable = aws["variable"]["replica_role_max_session_s"]
    assert variable["type"] == "number" and variable["default"] == 3600
    name = "var.replica_role_max_session_s"
    for good in (3600, 7200, 43200):
        assert _numeric_validation_accepts(variable, name, good), good
    for bad in (0, 900, 3599, 3600.5, 43201, 86400):
        assert not _numeric_validation_accepts(variable, name, bad), bad
    roles = aws["resource"]["aws_iam_role"]
    assert roles["replica"]["max_session_duration"] == "${var.replica_role_max_session_s}"
    assert roles["observer"]["max_session_duration"] == 3600


def test_aws_observer_policy_is_exactly_read_and_list(aws: dict[str, Any]) -> None:
    policy = aws["resource"]["aws_iam_policy"]["observer"]
    assert policy["policy"] == "${data.aws_iam_policy_document.observer.json}"
    statements = aws["data"]["aws_iam_policy_document"]["observer"]["statement"]
    keys = {"sid", "effect", "actions", "resources", "condition"}
    assert all(s["effect"] == "Allow" and set(s) <= keys for s in statements)
    assert sorted(a for s in statements for a in s["actions"]) == ["s3:GetObject", "s3:ListBucket"]
    by_action = {a: s for s in statements for a in s["actions"]}
    listing, reading = by_action["s3:ListBucket"], by_action["s3:GetObject"]
    assert listing["actions"] == ["s3:ListBucket"] and reading["actions"] == ["s3:GetObject"]
    assert listing["resources"] == ["${aws_s3_bucket.exchange.arn}"]
    assert _conditions(listing) == [{"test": "StringLike", "variable": "s3:prefix", "values": ["${var.prefix}*"]}]
    assert reading["resources"] == ["${aws_s3_bucket.exchange.arn}/${var.prefix}*"]
    assert "condition" not in reading
    assert aws["output"]["observer_policy_arn"]["value"] == "${aws_iam_policy.observer.arn}"
    role_arn = "${local.create_observer_role ? aws_iam_role.observer[0].arn : null}"
    assert aws["output"]["observer_role_arn"]["value"] == role_arn
    # The optional observer role: same trust rules (ExternalId always), its policy and nothing else.
    attachment = aws["resource"]["aws_iam_role_policy_attachment"]["observer"]
    assert attachment["policy_arn"] == "${aws_iam_policy.observer.arn}"
    trust = aws["data"]["aws_iam_policy_document"]["observer_trust"]
    (assume,) = trust["statement"]
    assert assume["actions"] == ["sts:AssumeRole"]
    assert _block(assume, "principals") == {"type": "AWS", "identifiers": "${var.observer_role_trusted_principals}"}
    assert _conditions(assume) == [
        {"test": "StringEquals", "variable": "sts:ExternalId", "values": ["${var.observer_role_external_id}"]}
    ]
    preconditions = [c["condition"] for block in trust["lifecycle"] for c in block["precondition"]]
    assert preconditions == ["${var.observer_role_external_id != null}"]


# --- GCP ---------------------------------------------------------------------------------------


def test_gcp_bucket_is_private_uniform_and_self_cleaning(gcp: dict[str, Any]) -> None:
    bucket = _only(gcp, "resource", "google_storage_bucket")
    assert bucket["uniform_bucket_level_access"] is True
    assert bucket["public_access_prevention"] == "enforced"
    assert bucket["force_destroy"] == "${var.force_destroy}"
    assert _block(bucket, "soft_delete_policy") == {"retention_duration_seconds": 0}
    assert _block(bucket, "versioning") == {"enabled": False}
    deleting = [_block(r, "condition") for r in bucket["lifecycle_rule"] if _block(r, "action") == {"type": "Delete"}]
    assert len(deleting) == 2
    assert {"age": "${var.expiration_days}", "matches_prefix": ["${var.prefix}"]} in deleting
    # the parts a killed composite upload left (store/_gcs.py, PART_SUFFIX)
    assert {"age": "${var.abort_incomplete_multipart_days}", "matches_suffix": [".diloco-part"]} in deleting
    assert any(_block(r, "action") == {"type": "AbortIncompleteMultipartUpload"} for r in bucket["lifecycle_rule"])
    assert "google_storage_bucket_acl" not in gcp["resource"]


def test_gcp_custom_role_has_exactly_object_permissions(gcp: dict[str, Any]) -> None:
    role = gcp["resource"]["google_project_iam_custom_role"]["replica"]
    assert role["permissions"] == "${local.replica_permissions}"
    assert sorted(gcp["locals"]["replica_permissions"]) == [
        "storage.objects.create",
        "storage.objects.delete",
        "storage.objects.get",
        "storage.objects.list",
    ]


def test_gcp_service_account_is_bound_on_the_bucket_only(gcp: dict[str, Any]) -> None:
    bindings = gcp["resource"]["google_storage_bucket_iam_member"]
    assert all(b["bucket"] == "${google_storage_bucket.exchange.name}" for b in bindings.values())
    binding = bindings["replica"]
    assert binding["bucket"] == "${google_storage_bucket.exchange.name}"
    assert binding["role"] == "${google_project_iam_custom_role.replica.id}"
    assert binding["member"] == "serviceAccount:${google_service_account.replica.email}"
    for project_wide in ("google_project_iam_member", "google_project_iam_binding", "google_project_iam_policy"):
        assert project_wide not in gcp["resource"], f"{project_wide} would grant beyond the bucket"
    condition = gcp["locals"]["prefix_condition"]
    assert "projects/_/buckets/${var.bucket_name}/objects/${var.prefix}" in condition
    assert "storage.googleapis.com/objectListPrefix" in condition


def test_gcp_per_run_binding_is_conditioned_on_the_run_prefix(gcp: dict[str, Any]) -> None:
    """run_ids gives each run its own service account, bound on <prefix><run id>/ only."""
    run_ids = gcp["variable"]["run_ids"]
    assert run_ids["type"] == "${set(string)}" and run_ids["default"] == []
    pattern = _validation_regex(run_ids, "run_id")
    assert pattern.fullmatch("run-20261129-214455-ab12") and pattern.fullmatch("r")
    for bad in ("a/b", "run-a/", "../run-b", "*", "", "-run", "a" * 129):
        assert not pattern.fullmatch(bad), bad
    account = gcp["resource"]["google_service_account"]["run"]
    assert account["for_each"] == "${var.run_ids}"
    assert account["account_id"] == "${local.run_account_ids[each.key]}"
    binding = gcp["resource"]["google_storage_bucket_iam_member"]["run"]
    assert binding["for_each"] == "${var.run_ids}"
    assert binding["bucket"] == "${google_storage_bucket.exchange.name}"
    assert binding["role"] == "${google_project_iam_custom_role.replica.id}"
    assert binding["member"] == "serviceAccount:${google_service_account.run[each.key].email}"
    assert "dynamic" not in binding, "the per-run condition cannot be switched off"
    assert _block(binding, "condition")["expression"] == "${local.run_conditions[each.key]}"
    conditions = gcp["locals"]["run_conditions"].replace('\\"', '"')
    assert conditions.startswith("${{for run_id in var.run_ids : run_id => ")
    objects = "projects/_/buckets/${var.bucket_name}/objects/${var.prefix}${run_id}/"
    assert f'resource.name.startsWith("{objects}")' in conditions
    assert (
        'api.getAttribute("storage.googleapis.com/objectListPrefix", "").startsWith("${var.prefix}${run_id}/")'
        in conditions
    )
    # The shared, prefix-wide binding can be dropped once every run has its own account.
    shared = gcp["resource"]["google_storage_bucket_iam_member"]["replica"]
    assert shared["count"] == "${var.replica_prefix_wide ? 1 : 0}"
    emails = gcp["output"]["run_service_accounts"]["value"]
    assert emails.startswith("${{for run_id, account in google_service_account.run")


def test_gcp_observer_role_is_exactly_get_and_list(gcp: dict[str, Any]) -> None:
    role = gcp["resource"]["google_project_iam_custom_role"]["observer"]
    assert role["permissions"] == "${local.observer_permissions}"
    assert sorted(gcp["locals"]["observer_permissions"]) == ["storage.objects.get", "storage.objects.list"]
    binding = gcp["resource"]["google_storage_bucket_iam_member"]["observer"]
    assert binding["bucket"] == "${google_storage_bucket.exchange.name}"
    assert binding["role"] == "${google_project_iam_custom_role.observer.id}"
    assert binding["member"] == "serviceAccount:${google_service_account.observer.email}"
    (dynamic,) = binding["dynamic"]
    assert dynamic["condition"]["for_each"] == "${var.restrict_to_prefix ? [local.prefix_condition] : []}"
    assert gcp["output"]["observer_service_account"]["value"] == "${google_service_account.observer.email}"
    assert gcp["output"]["observer_role_id"]["value"] == "${google_project_iam_custom_role.observer.id}"


@pytest.mark.parametrize(
    ("cloud", "failures"),
    [
        (
            "aws",
            {
                "${var.replica_role_max_session_s}",
                "${var.replica_role_external_id}",
                "${data.aws_iam_policy_document.replica_trust}",
                "${data.aws_iam_policy_document.observer_trust}",
                "${var.tags}",
            },
        ),
        ("gcp", {"${var.run_ids}"}),
    ],
)
def test_tftest_covers_the_identity_hardening(cloud: str, failures: set[str]) -> None:
    """terraform test refuses a role without ExternalId, sessions outside 1-12 h, a run tag in
    default_tags (AWS) and a run id with '/' (GCP)."""
    expected: set[str] = set()
    for path in (INFRA / cloud / "tests").glob("*.tftest.hcl"):
        for run in _parse(path)["run"]:
            for body in run.values():
                expected.update(body.get("expect_failures", []))
    assert failures <= expected


def test_no_wildcard_grants_anywhere(aws: dict[str, Any], gcp: dict[str, Any]) -> None:
    documents = aws["data"]["aws_iam_policy_document"]
    allow = [
        documents["replica"]["statement"], documents["observer"]["statement"], aws["locals"]["replica_session_policy"],
    ]
    assert not [s for s in _all_strings(allow) if s in ("*", "s3:*") or s.endswith(":*")]
    assert not [s for s in _all_strings(gcp["resource"]) if s in ("allUsers", "allAuthenticatedUsers")]
