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

run "apply_replica_policy_is_least_privilege" {
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
    ] == [[["StringLike", "s3:prefix", toset(["diloco/*"])]]]
    error_message = "ListBucket must be conditioned on s3:prefix = <prefix>*."
  }

  assert {
    condition = [
      for s in data.aws_iam_policy_document.replica.statement : [s.effect, toset(s.resources), length(s.condition)]
      if !contains(s.actions, "s3:ListBucket")
    ] == [["Allow", toset(["arn:aws:s3:::diloco-test-exchange/diloco/*"]), 0]]
    error_message = "Object actions must be allowed on <bucket>/<prefix>* only."
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
