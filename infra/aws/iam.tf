# Three identities touch the bucket (see ../README.md, "Identities"):
#
#   replica   one run only. aws_iam_policy.replica scopes every object action and the listing to
#             <prefix><run id>/, where the run id is the session tag `diloco-run-id` that the
#             launcher passes to sts:AssumeRole (aws:PrincipalTag/diloco-run-id below). A replica
#             of run A holds no permission on run B. Optional role with a trusted principal, an ExternalId, the
#             run tag required, and 1 h sessions by default.
#   observer  read-only: s3:GetObject and s3:ListBucket under the prefix, for `diloco status`,
#             `diloco logs` and `diloco ls`. No write, no delete. Optional role, same trust rules.
#   launcher  your own identity (or the one Terraform runs as): it is the trusted principal that
#             assumes the replica role for one run. Not created here.
#
# ListBucket also decides how S3 answers a GET/HEAD of a missing key: 404 NoSuchKey with it,
# 403 AccessDenied without. S3 evaluates that check with s3:prefix set to the requested key, so
# the prefix conditions below still yield honest 404s for keys under the run (or, for the
# observer, under the prefix), which the store relies on (ObjectNotFound vs StoreAccessDenied).
# Create-only writes (If-None-Match: *) need only s3:PutObject; multipart uploads need PutObject
# and AbortMultipartUpload.
#
# The run tag is spelled out (diloco-run-id) wherever a policy uses it, so that what IAM evaluates
# can be read here; `$${...}` is an IAM policy variable that Terraform leaves alone. Tag values
# cannot hold '*' or '?', so the substituted ARN is never a wildcard; '/' is refused by the trust
# policy. A principal without the tag resolves no resource: IAM treats a statement whose variable
# has no value as not matching, so it is allowed nothing (fail closed).

locals {
  run_tag_key = "diloco-run-id"

  # The session policy a launcher may pass to sts:AssumeRole (--policy) next to the run tag: the
  # session can then do no more than this, whatever the role's policies say. Replace {{run_id}}.
  replica_session_policy = {
    Version = "2012-10-17"
    Statement = [
      {
        Sid       = "ListOneRun"
        Effect    = "Allow"
        Action    = ["s3:ListBucket"]
        Resource  = [aws_s3_bucket.exchange.arn]
        Condition = { StringLike = { "s3:prefix" = ["${var.prefix}{{run_id}}/*"] } }
      },
      {
        Sid      = "ReadWriteOneRun"
        Effect   = "Allow"
        Action   = ["s3:AbortMultipartUpload", "s3:DeleteObject", "s3:GetObject", "s3:PutObject"]
        Resource = ["${aws_s3_bucket.exchange.arn}/${var.prefix}{{run_id}}/*"]
      },
    ]
  }
}

# --- replica: one run per session ----------------------------------------------------------------

data "aws_iam_policy_document" "replica" {
  statement {
    sid       = "ListOwnRun"
    effect    = "Allow"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.exchange.arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["${var.prefix}$${aws:PrincipalTag/diloco-run-id}/*"]
    }
  }

  statement {
    sid    = "ReadWriteOwnRunObjects"
    effect = "Allow"
    actions = [
      "s3:AbortMultipartUpload",
      "s3:DeleteObject",
      "s3:GetObject",
      "s3:PutObject",
    ]
    resources = ["${aws_s3_bucket.exchange.arn}/${var.prefix}$${aws:PrincipalTag/diloco-run-id}/*"]
  }
}

resource "aws_iam_policy" "replica" {
  name        = local.replica_policy_name
  description = "diloco-serverless replicas: list, read, write and delete objects under s3://${var.bucket_name}/${var.prefix}<run id>/ only, the run id being the principal tag diloco-run-id."
  policy      = data.aws_iam_policy_document.replica.json
}

data "aws_iam_policy_document" "replica_trust" {
  count = local.create_replica_role ? 1 : 0

  statement {
    sid     = "TrustedPrincipalsAssumeRoleForOneRun"
    effect  = "Allow"
    actions = ["sts:AssumeRole"]

    principals {
      type        = "AWS"
      identifiers = var.replica_role_trusted_principals
    }

    # Always required (not only across accounts): see variables.tf, replica_role_external_id.
    condition {
      test     = "StringEquals"
      variable = "sts:ExternalId"
      values   = [var.replica_role_external_id]
    }

    # No session without a run: the run tag must be passed (and sts:TagSession below allows it).
    condition {
      test     = "StringLike"
      variable = "aws:RequestTag/diloco-run-id"
      values   = ["?*"]
    }
  }

  statement {
    sid     = "TagSessionWithTheRunIdOnly"
    effect  = "Allow"
    actions = ["sts:TagSession"]

    principals {
      type        = "AWS"
      identifiers = var.replica_role_trusted_principals
    }

    condition {
      test     = "ForAllValues:StringEquals"
      variable = "aws:TagKeys"
      values   = ["diloco-run-id"]
    }

    condition {
      test     = "StringLike"
      variable = "aws:RequestTag/diloco-run-id"
      values   = ["?*"]
    }

    # A run id never holds '/' (config.RUN_ID_PATTERN); one that did could reach into another
    # run's folder (run "a/b" -> <prefix>a/b/* lies inside run "a").
    condition {
      test     = "StringNotLike"
      variable = "aws:RequestTag/diloco-run-id"
      values   = ["*/*"]
    }

    condition {
      test     = "ForAllValues:StringEquals"
      variable = "sts:TransitiveTagKeys"
      values   = ["diloco-run-id"]
    }
  }

  lifecycle {
    precondition {
      condition     = var.replica_role_external_id != null
      error_message = "replica_role_external_id is required (16 or more characters) when replica_role_trusted_principals is set: the trust policy always demands sts:ExternalId."
    }

    precondition {
      condition = !anytrue([
        for p in var.replica_role_trusted_principals : endswith(p, ":role/${local.replica_role_name}")
      ])
      error_message = "replica_role_trusted_principals must not name the replica role itself: a replica session could then re-assume the role with another run's tag."
    }
  }
}

resource "aws_iam_role" "replica" {
  count = local.create_replica_role ? 1 : 0

  name                 = local.replica_role_name
  description          = "Assumed for one diloco-serverless run (session tag diloco-run-id) to reach s3://${var.bucket_name}/${var.prefix}<run id>/."
  assume_role_policy   = data.aws_iam_policy_document.replica_trust[0].json
  max_session_duration = var.replica_role_max_session_s
}

resource "aws_iam_role_policy_attachment" "replica" {
  count = local.create_replica_role ? 1 : 0

  role       = aws_iam_role.replica[0].name
  policy_arn = aws_iam_policy.replica.arn
}

# --- observer: read-only, for status / logs / ls -------------------------------------------------

data "aws_iam_policy_document" "observer" {
  statement {
    sid       = "ListPrefix"
    effect    = "Allow"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.exchange.arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["${var.prefix}*"]
    }
  }

  statement {
    sid       = "ReadPrefixObjects"
    effect    = "Allow"
    actions   = ["s3:GetObject"]
    resources = ["${aws_s3_bucket.exchange.arn}/${var.prefix}*"]
  }
}

resource "aws_iam_policy" "observer" {
  name        = local.observer_policy_name
  description = "diloco-serverless observers (status, logs, ls): list and read objects under s3://${var.bucket_name}/${var.prefix} only; no write, no delete."
  policy      = data.aws_iam_policy_document.observer.json
}

data "aws_iam_policy_document" "observer_trust" {
  count = local.create_observer_role ? 1 : 0

  statement {
    sid     = "TrustedPrincipalsAssumeRole"
    effect  = "Allow"
    actions = ["sts:AssumeRole"]

    principals {
      type        = "AWS"
      identifiers = var.observer_role_trusted_principals
    }

    condition {
      test     = "StringEquals"
      variable = "sts:ExternalId"
      values   = [var.observer_role_external_id]
    }
  }

  lifecycle {
    precondition {
      condition     = var.observer_role_external_id != null
      error_message = "observer_role_external_id is required (16 or more characters) when observer_role_trusted_principals is set: the trust policy always demands sts:ExternalId."
    }
  }
}

resource "aws_iam_role" "observer" {
  count = local.create_observer_role ? 1 : 0

  name                 = local.observer_role_name
  description          = "Assumed by people and tools that only read diloco-serverless runs under s3://${var.bucket_name}/${var.prefix}."
  assume_role_policy   = data.aws_iam_policy_document.observer_trust[0].json
  max_session_duration = 3600
}

resource "aws_iam_role_policy_attachment" "observer" {
  count = local.create_observer_role ? 1 : 0

  role       = aws_iam_role.observer[0].name
  policy_arn = aws_iam_policy.observer.arn
}
