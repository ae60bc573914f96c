# The outputs `diloco launch --store-from-terraform` reads (diloco_serverless/terraform.py).
# Renaming one breaks the CLI: tests/infra/test_infra_contracts.py checks them.

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
  description = "ARN of the per-run IAM policy for replicas: objects under <prefix><run id>/ where the run id is the principal tag diloco-run-id (a session tag, or an IAM user tag)."
  value       = aws_iam_policy.replica.arn
}

output "replica_role_arn" {
  description = "ARN of the replica role (assume it with the run tag and the ExternalId), or null when replica_role_trusted_principals is empty."
  value       = local.create_replica_role ? aws_iam_role.replica[0].arn : null
}

output "run_tag_key" {
  description = "Session tag that names the one run a replica session may touch: pass --tags Key=<this>,Value=<run id> to sts:AssumeRole."
  value       = local.run_tag_key
}

output "replica_session_policy_template" {
  description = "JSON session policy limiting a session to one run: replace {{run_id}} and pass it as --policy to sts:AssumeRole, next to the run tag (belt and braces), or to scope any broader identity to one run."
  value       = jsonencode(local.replica_session_policy)
}

output "observer_policy_arn" {
  description = "ARN of the read-only IAM policy (s3:GetObject and s3:ListBucket under the prefix) for diloco status / logs / ls."
  value       = aws_iam_policy.observer.arn
}

output "observer_role_arn" {
  description = "ARN of the read-only observer role, or null when observer_role_trusted_principals is empty."
  value       = local.create_observer_role ? aws_iam_role.observer[0].arn : null
}
