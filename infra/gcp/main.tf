# The exchange bucket: uniform access, never public, self-cleaning, no soft delete.
# Everything the replicas write is throwaway (pseudo-gradients, round markers, checkpoints that
# expire), so there is no versioning and no access logging; see ../.checkov.yaml.

resource "google_storage_bucket" "exchange" {
  project       = var.project_id
  name          = var.bucket_name
  location      = var.location
  storage_class = var.storage_class
  force_destroy = var.force_destroy

  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"

  versioning {
    enabled = false
  }

  # Soft delete would keep every deleted tensor billable for 7 days; the data is throwaway.
  soft_delete_policy {
    retention_duration_seconds = 0
  }

  lifecycle_rule {
    condition {
      age            = var.expiration_days
      matches_prefix = [var.prefix]
    }
    action {
      type = "Delete"
    }
  }

  lifecycle_rule {
    condition {
      age = var.abort_incomplete_multipart_days
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }

  # The parts of a composite upload (objects over the part size, e.g. checkpoints) are temporary
  # objects ending in .diloco-part, deleted after each upload; these are what a killed replica left.
  lifecycle_rule {
    condition {
      age            = var.abort_incomplete_multipart_days
      matches_suffix = [".diloco-part"]
    }
    action {
      type = "Delete"
    }
  }

  dynamic "encryption" {
    for_each = var.kms_key_name == null ? [] : [var.kms_key_name]
    content {
      default_kms_key_name = encryption.value
    }
  }
}
