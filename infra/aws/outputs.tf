# The outputs `diloco launch --store-from-terraform` reads (diloco_serverless/terraform.py).
# Renaming one breaks the CLI: tests/test_infra_contracts.py checks them.

output "exchange_url" {
  description = "Store URL to launch against: s3://<bucket>/<prefix> (ends with '/')."
  value       = "s3://${aws_s3_bucket.exchange.bucket}/${var.prefix}"
}

output "bucket" {
  description = "Name of the exchange bucket."
  value       = aws_s3_bucket.exchange.bucket
}

output "bucket_arn" {
  description = "ARN of the exchange bucket."
  value       = aws_s3_bucket.exchange.arn
}

output "prefix" {
  description = "Key prefix the replicas are confined to."
  value       = var.prefix
}

output "region" {
  description = "AWS region of the bucket; replicas need it as AWS_DEFAULT_REGION."
  value       = var.region
}

output "expiration_days" {
  description = "Days after which objects under the prefix are deleted by the lifecycle rule."
  value       = var.expiration_days
}

output "replica_policy_arn" {
  description = "ARN of the least-privilege IAM policy for replicas; attach it to the identity whose credentials the replicas use."
  value       = aws_iam_policy.replica.arn
}

output "replica_role_arn" {
  description = "ARN of the replica role, or null when replica_role_trusted_principals is empty."
  value       = local.create_replica_role ? aws_iam_role.replica[0].arn : null
}
