# Least privilege for replicas: a service account with a custom role of exactly
# storage.objects.get/create/delete/list, bound on the exchange bucket only (not the project),
# optionally conditioned on the run prefix.

locals {
  replica_permissions = [
    "storage.objects.create",
    "storage.objects.delete",
    "storage.objects.get",
    "storage.objects.list",
  ]

  # Objects: their resource name starts with the prefix. Lists: the requested list prefix does.
  # https://cloud.google.com/storage/docs/access-control/iam#conditions
  prefix_condition = join(" || ", [
    "resource.name.startsWith(\"projects/_/buckets/${var.bucket_name}/objects/${var.prefix}\")",
    "api.getAttribute(\"storage.googleapis.com/objectListPrefix\", \"\").startsWith(\"${var.prefix}\")",
  ])
}

resource "google_service_account" "replica" {
  project      = var.project_id
  account_id   = var.service_account_id
  display_name = "diloco-serverless replica"
  description  = "Replicas of diloco-serverless runs: objects under gs://${var.bucket_name}/${var.prefix} only."
}

resource "google_project_iam_custom_role" "replica" {
  project     = var.project_id
  role_id     = var.custom_role_id
  title       = "diloco-serverless replica objects"
  description = "Read, create, delete and list objects; bound on the exchange bucket only."
  permissions = local.replica_permissions
  stage       = "GA"
}

resource "google_storage_bucket_iam_member" "replica" {
  bucket = google_storage_bucket.exchange.name
  role   = google_project_iam_custom_role.replica.id
  member = "serviceAccount:${google_service_account.replica.email}"

  dynamic "condition" {
    for_each = var.restrict_to_prefix ? [local.prefix_condition] : []
    content {
      title       = "diloco-run-prefix-only"
      description = "Objects and listings under ${var.prefix} only."
      expression  = condition.value
    }
  }
}
