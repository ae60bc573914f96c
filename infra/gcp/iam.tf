# Three identities touch the bucket (see ../README.md, "Identities"):
#
#   replica   google_service_account.replica, bound on the bucket with a custom role of exactly
#             storage.objects.get/create/delete/list, conditioned on the prefix: every run.
#   run       one service account per entry of var.run_ids, bound with the same role but
#             conditioned on <prefix><run id>/ only. GCP has no session tags, so per-run scoping is
#             per-run service accounts: give a run's replicas its account and they cannot touch
#             another run. Set replica_prefix_wide = false once no run uses the shared account.
#   observer  google_service_account.observer with a custom role of exactly storage.objects.get and
#             storage.objects.list, on the prefix: diloco status / logs / ls. No write, no delete.

locals {
  replica_permissions = [
    "storage.objects.create",
    "storage.objects.delete",
    "storage.objects.get",
    "storage.objects.list",
  ]

  observer_permissions = [
    "storage.objects.get",
    "storage.objects.list",
  ]

  # Objects: their resource name starts with the prefix. Lists: the requested list prefix does.
  # https://cloud.google.com/storage/docs/access-control/iam#conditions
  prefix_condition = join(" || ", [
    "resource.name.startsWith(\"projects/_/buckets/${var.bucket_name}/objects/${var.prefix}\")",
    "api.getAttribute(\"storage.googleapis.com/objectListPrefix\", \"\").startsWith(\"${var.prefix}\")",
  ])

  # The same, for one run's folder <prefix><run id>/ (the trailing '/' keeps run "a" out of "ab").
  run_conditions = {
    for run_id in var.run_ids : run_id => join(" || ", [
      "resource.name.startsWith(\"projects/_/buckets/${var.bucket_name}/objects/${var.prefix}${run_id}/\")",
      "api.getAttribute(\"storage.googleapis.com/objectListPrefix\", \"\").startsWith(\"${var.prefix}${run_id}/\")",
    ])
  }

  # Service account IDs are 6-30 characters; run ids up to 128, so derive a stable short ID.
  run_account_ids = {
    for run_id in var.run_ids : run_id => "${var.run_service_account_prefix}-${substr(sha256(run_id), 0, 29 - length(var.run_service_account_prefix))}"
  }
}

# --- replica: the whole prefix (every run) --------------------------------------------------------

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
  count = var.replica_prefix_wide ? 1 : 0

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

# The binding had no count before replica_prefix_wide: keep it in place on upgrade.
moved {
  from = google_storage_bucket_iam_member.replica
  to   = google_storage_bucket_iam_member.replica[0]
}

# --- run: one service account per run, bound on that run's folder only ----------------------------

resource "google_service_account" "run" {
  for_each = var.run_ids

  project      = var.project_id
  account_id   = local.run_account_ids[each.key]
  display_name = substr("diloco run ${each.key}", 0, 100)
  description  = substr("Replicas of the diloco-serverless run ${each.key}: objects under gs://${var.bucket_name}/${var.prefix}${each.key}/ only.", 0, 256)
}

resource "google_storage_bucket_iam_member" "run" {
  for_each = var.run_ids

  bucket = google_storage_bucket.exchange.name
  role   = google_project_iam_custom_role.replica.id
  member = "serviceAccount:${google_service_account.run[each.key].email}"

  condition {
    title       = "diloco-one-run-only"
    description = substr("Objects and listings under ${var.prefix}${each.key}/ only.", 0, 256)
    expression  = local.run_conditions[each.key]
  }
}

# --- observer: read-only, for status / logs / ls --------------------------------------------------

resource "google_service_account" "observer" {
  project      = var.project_id
  account_id   = var.observer_service_account_id
  display_name = "diloco-serverless observer"
  description  = "Reads diloco-serverless runs (status, logs, ls): get and list objects under gs://${var.bucket_name}/${var.prefix} only."
}

resource "google_project_iam_custom_role" "observer" {
  project     = var.project_id
  role_id     = var.observer_custom_role_id
  title       = "diloco-serverless observer objects"
  description = "Read and list objects; bound on the exchange bucket only. No create, no delete."
  permissions = local.observer_permissions
  stage       = "GA"
}

resource "google_storage_bucket_iam_member" "observer" {
  bucket = google_storage_bucket.exchange.name
  role   = google_project_iam_custom_role.observer.id
  member = "serviceAccount:${google_service_account.observer.email}"

  dynamic "condition" {
    for_each = var.restrict_to_prefix ? [local.prefix_condition] : []
    content {
      title       = "diloco-prefix-read-only"
      description = "Objects and listings under ${var.prefix} only."
      expression  = condition.value
    }
  }
}
