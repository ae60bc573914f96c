terraform {
  # 1.7 is the first release with `mock_provider` in `terraform test`.
  required_version = ">= 1.7.0"

  required_providers {
    google = {
      source = "hashicorp/google"
      # soft_delete_policy on google_storage_bucket needs 5.25 or later.
      version = ">= 5.25.0, < 7.0.0"
    }
  }
}

provider "google" {
  project = var.project_id
  region  = var.region

  default_labels = var.labels
}
