# The outputs `diloco launch --store-from-terraform` reads (diloco_serverless/terraform.py).
# Renaming one breaks the CLI: tests/infra/test_infra_contracts.py checks them.

output "exchange_url" {
  description = "Store URL to launch against: gs://<bucket>/<prefix> (ends with '/')."
  value       = "gs://${google_storage_bucket.exchange.name}/${var.prefix}"
}

output "bucket" {
  description = "Name of the exchange bucket."
  value       = google_storage_bucket.exchange.name
}

output "prefix" {
  description = "Object name prefix the replicas are confined to."
  value       = var.prefix
}

output "location" {
  description = "Location of the bucket."
  value       = var.location
}

output "project_id" {
  description = "Project that owns the bucket and the service account."
  value       = var.project_id
}

output "expiration_days" {
  description = "Days after which objects under the prefix are deleted by the lifecycle rule."
  value       = var.expiration_days
}

output "replica_service_account" {
  description = "Email of the shared replica service account (every run under the prefix while replica_prefix_wide is true); prefer a per-run account from run_service_accounts."
  value       = google_service_account.replica.email
}

output "replica_role_id" {
  description = "ID of the custom role bound on the bucket (projects/<project>/roles/<role>)."
  value       = google_project_iam_custom_role.replica.id
}

output "run_service_accounts" {
  description = "Per-run service account emails by run id (from run_ids); each may touch gs://<bucket>/<prefix><run id>/ only."
  value       = { for run_id, account in google_service_account.run : run_id => account.email }
}

output "observer_service_account" {
  description = "Email of the read-only observer service account (storage.objects.get and storage.objects.list under the prefix) for diloco status / logs / ls."
  value       = google_service_account.observer.email
}

output "observer_role_id" {
  description = "ID of the observer's custom role (projects/<project>/roles/<role>)."
  value       = google_project_iam_custom_role.observer.id
}
