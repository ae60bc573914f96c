# `terraform test` for the AWS exchange module. Runs offline: the provider is mocked, so no
# credentials are needed and nothing is created. Run from infra/aws: terraform init && terraform test

mock_provider "aws" {
  # Policy documents are rendered by the provider; give the mock a valid JSON document so the
  # bucket policy and IAM policy arguments validate.
  mock_data "aws_iam_policy_document" {
    defaults = {
      json = "{\"Version\":\"2012-10-17\",\"Statement\":[]}"
    }
  }

  mock_resource "aws_s3_bucket" {
    defaults = {
      arn = "arn:aws:s3:::diloco-test-exchange"
    }
  }

  mock_resource "aws_iam_policy" {
    defaults = {
      arn = "arn:aws:iam::123456789012:policy/diloco-test-exchange-diloco-replica"
    }
  }

  mock_resource "aws_iam_role" {
    defaults = {
      arn = "arn:aws:iam::123456789012:role/diloco-test-exchange-diloco-replica"
    }
  }
}

override_resource {
  target = aws_iam_policy.observer
  values = {
    arn = "arn:aws:iam::123456789012:policy/diloco-test-exchange-diloco-observer"
  }
}

override_resource {
  target = aws_iam_role.observer
  values = {
    arn = "arn:aws:iam::123456789012:role/diloco-test-exchange-diloco-observer"
  }
}

variables {
  bucket_name     = "diloco-test-exchange"
  region          = "us-east-1"
  prefix          = "diloco/"
  expiration_days = 7
}

run "plan_secure_bucket" {
  command = plan

  assert {
    condition = alltrue([
      aws_s3_bucket_public_access_block.exchange.block_public_acls,
      aws_s3_bucket_public_access_block.exchange.block_public_policy,
      aws_s3_bucket_public_access_block.exchange.ignore_public_acls,
      aws_s3_bucket_public_access_block.exchange.restrict_public_buckets,
    ])
    error_message = "All four public access block settings must be on."
  }

  assert {
    condition     = one(aws_s3_bucket_ownership_controls.exchange.rule).object_ownership == "BucketOwnerEnforced"
    error_message = "Object ownership must be BucketOwnerEnforced (ACLs disabled)."
  }

  assert {
    condition     = one(one(aws_s3_bucket_server_side_encryption_configuration.exchange.rule).apply_server_side_encryption_by_default).sse_algorithm == "AES256"
    error_message = "Without a KMS key the bucket must use SSE-S3 (AES256)."
  }

  assert {
    condition     = aws_s3_bucket.exchange.force_destroy == false
    error_message = "force_destroy must default to false."
  }

  assert {
    condition = [
      for r in aws_s3_bucket_lifecycle_configuration.exchange.rule :
      [r.status, one(r.filter).prefix, one(r.expiration).days] if length(r.expiration) > 0
    ] == [["Enabled", "diloco/", 7]]
    error_message = "Exactly one lifecycle rule must expire the run prefix after expiration_days."
  }

  assert {
    condition = [
      for r in aws_s3_bucket_lifecycle_configuration.exchange.rule :
      [r.status, one(r.abort_incomplete_multipart_upload).days_after_initiation]
      if length(r.abort_incomplete_multipart_upload) > 0
    ] == [["Enabled", 1]]
    error_message = "A bucket-wide lifecycle rule must abort incomplete multipart uploads after a day."
  }

  assert {
    condition     = length(aws_iam_role.replica) == 0
    error_message = "No replica role is created without trusted principals."
  }

  assert {
    condition     = output.exchange_url == "s3://diloco-test-exchange/diloco/"
    error_message = "exchange_url must be s3://<bucket>/<prefix>."
  }

  assert {
    condition     = output.expiration_days == 7 && output.region == "us-east-1" && output.bucket == "diloco-test-exchange"
    error_message = "Outputs the CLI reads must echo the inputs."
  }
}

run "apply_replica_policy_is_least_privilege_and_per_run" {
  # apply: the bucket ARN the policy refers to is known only after the (mocked) create.
  command = apply

  assert {
    condition = toset(flatten([
      for s in data.aws_iam_policy_document.replica.statement : s.actions
    ])) == toset(["s3:ListBucket", "s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"])
    error_message = "The replica policy must grant exactly ListBucket, GetObject, PutObject, DeleteObject and AbortMultipartUpload."
  }

  assert {
    condition = [
      for s in data.aws_iam_policy_document.replica.statement : [s.effect, toset(s.resources)]
      if toset(s.actions) == toset(["s3:ListBucket"])
    ] == [["Allow", toset(["arn:aws:s3:::diloco-test-exchange"])]]
    error_message = "ListBucket must be allowed on the exchange bucket only."
  }

  assert {
    condition = [
      for s in data.aws_iam_policy_document.replica.statement :
      [for c in s.condition : [c.test, c.variable, toset(c.values)]]
      if toset(s.actions) == toset(["s3:ListBucket"])
    ] == [[["StringLike", "s3:prefix", toset(["diloco/$${aws:PrincipalTag/diloco-run-id}/*"])]]]
    error_message = "ListBucket must be conditioned on s3:prefix = <prefix><run tag>/*: one run, not the whole prefix."
  }

  assert {
    condition = [
      for s in data.aws_iam_policy_document.replica.statement : [s.effect, toset(s.resources), length(s.condition)]
      if !contains(s.actions, "s3:ListBucket")
    ] == [["Allow", toset(["arn:aws:s3:::diloco-test-exchange/diloco/$${aws:PrincipalTag/diloco-run-id}/*"]), 0]]
    error_message = "Object actions must be allowed on <bucket>/<prefix><run tag>/* only."
  }

  assert {
    condition     = output.run_tag_key == "diloco-run-id"
    error_message = "run_tag_key must name the session tag the policy reads."
  }
}

run "apply_session_policy_template_scopes_one_run" {
  command = apply

  assert {
    condition = [
      for s in jsondecode(output.replica_session_policy_template).Statement : s.Resource
      ] == [
      ["arn:aws:s3:::diloco-test-exchange"],
      ["arn:aws:s3:::diloco-test-exchange/diloco/{{run_id}}/*"],
    ]
    error_message = "The session policy template must reach the bucket (list) and <prefix>{{run_id}}/* (objects) only."
  }

  assert {
    condition     = jsondecode(output.replica_session_policy_template).Statement[0].Condition == { StringLike = { "s3:prefix" = ["diloco/{{run_id}}/*"] } }
    error_message = "The template's listing must be limited to <prefix>{{run_id}}/*."
  }

  assert {
    condition = toset(flatten([
      for s in jsondecode(output.replica_session_policy_template).Statement : s.Action
    ])) == toset(["s3:ListBucket", "s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"])
    error_message = "The session policy template grants no more actions than the replica policy."
  }
}

run "apply_observer_is_read_only" {
  command = apply

  variables {
    observer_role_trusted_principals = ["arn:aws:iam::123456789012:user/alice"]
    observer_role_external_id        = "observer-external-id-0123"
  }

  assert {
    condition = [
      for s in data.aws_iam_policy_document.observer.statement : [s.effect, toset(s.actions), toset(s.resources)]
      ] == [
      ["Allow", toset(["s3:ListBucket"]), toset(["arn:aws:s3:::diloco-test-exchange"])],
      ["Allow", toset(["s3:GetObject"]), toset(["arn:aws:s3:::diloco-test-exchange/diloco/*"])],
    ]
    error_message = "The observer policy must grant exactly ListBucket on the bucket and GetObject under the prefix."
  }

  assert {
    condition = [
      for s in data.aws_iam_policy_document.observer.statement :
      [for c in s.condition : [c.test, c.variable, toset(c.values)]]
    ] == [[["StringLike", "s3:prefix", toset(["diloco/*"])]], []]
    error_message = "The observer's listing must be limited to the prefix."
  }

  assert {
    condition     = output.observer_policy_arn == "arn:aws:iam::123456789012:policy/diloco-test-exchange-diloco-observer"
    error_message = "observer_policy_arn must be output."
  }

  assert {
    condition     = output.observer_role_arn == "arn:aws:iam::123456789012:role/diloco-test-exchange-diloco-observer"
    error_message = "observer_role_arn must be output when the role exists."
  }

  assert {
    condition     = aws_iam_role.observer[0].max_session_duration == 3600 && aws_iam_role_policy_attachment.observer[0].policy_arn == aws_iam_policy.observer.arn
    error_message = "The observer role carries the observer policy, with 1 h sessions."
  }

  assert {
    condition = [
      for s in data.aws_iam_policy_document.observer_trust[0].statement :
      toset([for c in s.condition : [c.test, c.variable, toset(nonsensitive(c.values))]])
    ] == [toset([["StringEquals", "sts:ExternalId", toset(["observer-external-id-0123"])]])]
    error_message = "The observer trust policy must demand the ExternalId."
  }
}

run "plan_default_session_is_one_hour" {
  command = plan

  variables {
    replica_role_trusted_principals = ["arn:aws:iam::123456789012:user/diloco-launcher"]
    replica_role_external_id        = "0123456789abcdef0123"
  }

  assert {
    condition     = aws_iam_role.replica[0].max_session_duration == 3600
    error_message = "Replica sessions must last at most 1 h by default."
  }

  assert {
    condition     = length(aws_iam_role.observer) == 0 && output.observer_role_arn == null
    error_message = "No observer role is created without observer principals."
  }
}

run "apply_with_replica_role" {
  command = apply

  variables {
    replica_role_trusted_principals = ["arn:aws:iam::123456789012:user/diloco-replicas"]
    replica_role_external_id        = "test-external-id"
    kms_key_arn                     = "arn:aws:kms:us-east-1:123456789012:key/00000000-0000-0000-0000-000000000000"
    force_destroy                   = true
  }

  assert {
    condition     = length(aws_iam_role.replica) == 1 && length(aws_iam_role_policy_attachment.replica) == 1
    error_message = "Trusted principals must create the replica role and attach the policy to it."
  }

  assert {
    condition     = aws_iam_role_policy_attachment.replica[0].policy_arn == aws_iam_policy.replica.arn
    error_message = "The role must carry the replica policy."
  }

  assert {
    condition     = output.replica_role_arn == "arn:aws:iam::123456789012:role/diloco-test-exchange-diloco-replica"
    error_message = "replica_role_arn must be output when the role exists."
  }

  assert {
    condition     = output.replica_policy_arn == "arn:aws:iam::123456789012:policy/diloco-test-exchange-diloco-replica"
    error_message = "replica_policy_arn must be output."
  }

  assert {
    condition     = one(one(aws_s3_bucket_server_side_encryption_configuration.exchange.rule).apply_server_side_encryption_by_default).sse_algorithm == "aws:kms"
    error_message = "A KMS key switches encryption to SSE-KMS."
  }

  assert {
    condition     = aws_s3_bucket.exchange.force_destroy == true
    error_message = "force_destroy must follow its variable."
  }

  assert {
    condition = [
      for s in data.aws_iam_policy_document.replica_trust[0].statement :
      [toset(s.actions), toset([for c in s.condition : [c.test, c.variable, toset(nonsensitive(c.values))]])]
      ] == [
      [toset(["sts:AssumeRole"]), toset([
        ["StringEquals", "sts:ExternalId", toset(["test-external-id"])],
        ["StringLike", "aws:RequestTag/diloco-run-id", toset(["?*"])],
      ])],
      [toset(["sts:TagSession"]), toset([
        ["ForAllValues:StringEquals", "aws:TagKeys", toset(["diloco-run-id"])],
        ["StringLike", "aws:RequestTag/diloco-run-id", toset(["?*"])],
        ["StringNotLike", "aws:RequestTag/diloco-run-id", toset(["*/*"])],
        ["ForAllValues:StringEquals", "sts:TransitiveTagKeys", toset(["diloco-run-id"])],
      ])],
    ]
    error_message = "The trust policy must demand the ExternalId and the run tag, and allow sts:TagSession with the diloco-run-id key only."
  }

  assert {
    condition     = aws_iam_role.replica[0].max_session_duration == 3600
    error_message = "Replica sessions must last at most 1 h by default."
  }
}

run "apply_with_longer_sessions" {
  command = apply

  variables {
    replica_role_trusted_principals = ["arn:aws:iam::210987654321:role/launcher"]
    replica_role_external_id        = "0123456789abcdef0123"
    replica_role_max_session_s      = 43200
  }

  assert {
    condition     = aws_iam_role.replica[0].max_session_duration == 43200
    error_message = "replica_role_max_session_s must set the role's maximum session."
  }
}

run "apply_without_role" {
  command = apply

  assert {
    condition     = output.replica_role_arn == null
    error_message = "replica_role_arn must be null without trusted principals."
  }
}

run "rejects_prefix_without_trailing_slash" {
  command = plan

  variables {
    prefix = "diloco"
  }

  expect_failures = [var.prefix]
}

run "rejects_prefix_with_wildcard" {
  command = plan

  variables {
    prefix = "runs/*/"
  }

  expect_failures = [var.prefix]
}

run "rejects_zero_expiration_days" {
  command = plan

  variables {
    expiration_days = 0
  }

  expect_failures = [var.expiration_days]
}

run "rejects_fractional_expiration_days" {
  command = plan

  variables {
    expiration_days = 1.5
  }

  expect_failures = [var.expiration_days]
}

run "rejects_invalid_bucket_name" {
  command = plan

  variables {
    bucket_name = "My_Bucket"
  }

  expect_failures = [var.bucket_name]
}

run "rejects_ip_shaped_bucket_name" {
  command = plan

  variables {
    bucket_name = "192.168.0.1"
  }

  expect_failures = [var.bucket_name]
}

run "rejects_wildcard_trusted_principal" {
  command = plan

  variables {
    replica_role_trusted_principals = ["*"]
  }

  expect_failures = [var.replica_role_trusted_principals]
}

run "rejects_one_character_external_id" {
  command = plan

  variables {
    replica_role_trusted_principals = ["arn:aws:iam::123456789012:root"]
    replica_role_external_id        = "x"
  }

  expect_failures = [var.replica_role_external_id]
}

run "rejects_role_without_external_id" {
  command = plan

  variables {
    replica_role_trusted_principals = ["arn:aws:iam::210987654321:root"]
  }

  expect_failures = [data.aws_iam_policy_document.replica_trust]
}

run "rejects_same_account_role_without_external_id" {
  command = plan

  variables {
    replica_role_trusted_principals = ["arn:aws:iam::123456789012:role/launcher"]
  }

  expect_failures = [data.aws_iam_policy_document.replica_trust]
}

run "rejects_fifteen_character_external_id" {
  command = plan

  variables {
    replica_role_trusted_principals = ["arn:aws:iam::210987654321:root"]
    replica_role_external_id        = "0123456789abcde"
  }

  expect_failures = [var.replica_role_external_id]
}

run "rejects_replica_role_trusting_itself" {
  command = plan

  variables {
    replica_role_trusted_principals = ["arn:aws:iam::123456789012:role/diloco-test-exchange-diloco-replica"]
    replica_role_external_id        = "0123456789abcdef0123"
  }

  expect_failures = [data.aws_iam_policy_document.replica_trust]
}

run "rejects_observer_role_without_external_id" {
  command = plan

  variables {
    observer_role_trusted_principals = ["arn:aws:iam::210987654321:user/alice"]
  }

  expect_failures = [data.aws_iam_policy_document.observer_trust]
}

run "rejects_session_longer_than_12_hours" {
  command = plan

  variables {
    replica_role_max_session_s = 43201
  }

  expect_failures = [var.replica_role_max_session_s]
}

run "rejects_session_shorter_than_1_hour" {
  command = plan

  variables {
    replica_role_max_session_s = 1800
  }

  expect_failures = [var.replica_role_max_session_s]
}

run "rejects_run_tag_in_default_tags" {
  command = plan

  variables {
    tags = { "Diloco-Run-Id" = "run-a" }
  }

  expect_failures = [var.tags]
}
