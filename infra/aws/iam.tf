# Least privilege for replicas: list the run prefix, and read/write/delete objects under it.
# Nothing else: no bucket configuration, no other prefixes, no other buckets.
#
# ListBucket also decides how S3 answers a GET/HEAD of a missing key: 404 NoSuchKey with it,
# 403 AccessDenied without. S3 evaluates that check with s3:prefix set to the requested key, so
# the prefix condition below still yields honest 404s for keys under the prefix, which the store
# relies on (ObjectNotFound vs StoreAccessDenied). Create-only writes (If-None-Match: *) need
# only s3:PutObject; multipart uploads need PutObject and AbortMultipartUpload.

data "aws_iam_policy_document" "replica" {
  statement {
    sid       = "ListRunPrefix"
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
    sid    = "ReadWriteRunObjects"
    effect = "Allow"
    actions = [
      "s3:AbortMultipartUpload",
      "s3:DeleteObject",
      "s3:GetObject",
      "s3:PutObject",
    ]
    resources = ["${aws_s3_bucket.exchange.arn}/${var.prefix}*"]
  }
}

resource "aws_iam_policy" "replica" {
  name        = local.replica_policy_name
  description = "diloco-serverless replicas: list, read, write and delete objects under s3://${var.bucket_name}/${var.prefix} only."
  policy      = data.aws_iam_policy_document.replica.json
}

data "aws_iam_policy_document" "replica_trust" {
  count = local.create_replica_role ? 1 : 0

  statement {
    sid     = "TrustedPrincipalsAssumeRole"
    effect  = "Allow"
    actions = ["sts:AssumeRole"]

    principals {
      type        = "AWS"
      identifiers = var.replica_role_trusted_principals
    }

    dynamic "condition" {
      for_each = var.replica_role_external_id == null ? [] : [var.replica_role_external_id]
      content {
        test     = "StringEquals"
        variable = "sts:ExternalId"
        values   = [condition.value]
      }
    }
  }
}

resource "aws_iam_role" "replica" {
  count = local.create_replica_role ? 1 : 0

  name                 = local.replica_role_name
  description          = "Assumed by diloco-serverless replicas to reach s3://${var.bucket_name}/${var.prefix}."
  assume_role_policy   = data.aws_iam_policy_document.replica_trust[0].json
  max_session_duration = var.replica_role_max_session_s
}

resource "aws_iam_role_policy_attachment" "replica" {
  count = local.create_replica_role ? 1 : 0

  role       = aws_iam_role.replica[0].name
  policy_arn = aws_iam_policy.replica.arn
}
