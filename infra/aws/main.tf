# The exchange bucket: private, owner-enforced, encrypted, TLS-only, and self-cleaning.
# Everything the replicas write is throwaway (pseudo-gradients, round markers, checkpoints that
# expire), so there is no versioning, replication or access logging; see ../.checkov.yaml.

locals {
  replica_policy_name  = coalesce(var.replica_policy_name, "${var.bucket_name}-diloco-replica")
  replica_role_name    = coalesce(var.replica_role_name, substr("${var.bucket_name}-diloco-replica", 0, 64))
  create_replica_role  = length(var.replica_role_trusted_principals) > 0
  observer_policy_name = coalesce(var.observer_policy_name, "${var.bucket_name}-diloco-observer")
  observer_role_name   = coalesce(var.observer_role_name, substr("${var.bucket_name}-diloco-observer", 0, 64))
  create_observer_role = length(var.observer_role_trusted_principals) > 0
  sse_algorithm        = var.kms_key_arn == null ? "AES256" : "aws:kms"
}

resource "aws_s3_bucket" "exchange" {
  bucket        = var.bucket_name
  force_destroy = var.force_destroy
}

resource "aws_s3_bucket_public_access_block" "exchange" {
  bucket = aws_s3_bucket.exchange.id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "exchange" {
  bucket = aws_s3_bucket.exchange.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "exchange" {
  bucket = aws_s3_bucket.exchange.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = local.sse_algorithm
      kms_master_key_id = var.kms_key_arn
    }
    bucket_key_enabled = var.kms_key_arn != null
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "exchange" {
  bucket = aws_s3_bucket.exchange.id

  rule {
    id     = "expire-run-prefix"
    status = "Enabled"

    filter {
      prefix = var.prefix
    }

    expiration {
      days = var.expiration_days
    }
  }

  rule {
    id     = "abort-incomplete-multipart-uploads"
    status = "Enabled"

    filter {}

    abort_incomplete_multipart_upload {
      days_after_initiation = var.abort_incomplete_multipart_days
    }
  }
}

data "aws_iam_policy_document" "tls_only" {
  statement {
    sid     = "DenyInsecureTransport"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.exchange.arn,
      "${aws_s3_bucket.exchange.arn}/*",
    ]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }

  statement {
    sid     = "DenyOutdatedTLS"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.exchange.arn,
      "${aws_s3_bucket.exchange.arn}/*",
    ]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "NumericLessThan"
      variable = "s3:TlsVersion"
      values   = ["1.2"]
    }
  }
}

resource "aws_s3_bucket_policy" "exchange" {
  bucket = aws_s3_bucket.exchange.id
  policy = data.aws_iam_policy_document.tls_only.json

  # S3 rejects some policy writes while the public access block is being applied.
  depends_on = [aws_s3_bucket_public_access_block.exchange]
}
