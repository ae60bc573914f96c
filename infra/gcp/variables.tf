variable "project_id" {
  description = "ID of the Google Cloud project that owns the bucket, the service account and the custom role."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.project_id))
    error_message = "project_id must be a project ID (6-30 characters: lowercase letters, digits and hyphens, starting with a letter), not a project name or number."
  }
}

variable "bucket_name" {
  description = "Name of the GCS bucket the replicas exchange pseudo-gradients through. Globally unique, 3-63 characters of lowercase letters, digits, '-', '_' and '.'."
  type        = string

  validation {
    condition = alltrue([
      can(regex("^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$", var.bucket_name)),
      !strcontains(var.bucket_name, ".."),
      !can(regex("^[0-9]+\\.[0-9]+\\.[0-9]+\\.[0-9]+$", var.bucket_name)),
      !startswith(var.bucket_name, "goog"),
      !strcontains(var.bucket_name, "google"),
    ])
    error_message = "bucket_name must be 3-63 characters of lowercase letters, digits, '-', '_' and '.', start and end with a letter or digit, contain no '..', not look like an IP address, not start with \"goog\" and not contain \"google\"."
  }
}

variable "location" {
  description = "Location of the bucket: a region (us-central1), dual-region or multi-region (US, EU). Put it next to the GPUs."
  type        = string
  default     = "us-central1"

  validation {
    condition     = can(regex("^[A-Za-z]+[A-Za-z0-9-]*[0-9A-Za-z]$", var.location))
    error_message = "location must be a GCS location such as us-central1, US or EU."
  }
}

variable "region" {
  description = "Default region of the google provider (no regional resources are created besides the bucket)."
  type        = string
  default     = "us-central1"
}

variable "prefix" {
  description = "Object name prefix under which runs live; the exchange URL is gs://<bucket>/<prefix>. Must end with '/'."
  type        = string
  default     = "diloco/"

  validation {
    condition     = can(regex("^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*/$", var.prefix))
    error_message = "prefix must be one or more '/'-separated segments of letters, digits, '.', '_' or '-', must not start with '/', and must end with '/' (for example \"diloco/\")."
  }
}

variable "expiration_days" {
  description = "Days after which every object under the prefix (runs, rounds, checkpoints, final models) is deleted. Copy a final model elsewhere before then."
  type        = number
  default     = 14

  validation {
    condition     = var.expiration_days > 0 && floor(var.expiration_days) == var.expiration_days
    error_message = "expiration_days must be a positive whole number of days."
  }
}

variable "abort_incomplete_multipart_days" {
  description = "Days after which incomplete XML-API multipart uploads, and the leftover parts of composite uploads (*.diloco-part), anywhere in the bucket are deleted."
  type        = number
  default     = 1

  validation {
    condition     = var.abort_incomplete_multipart_days > 0 && floor(var.abort_incomplete_multipart_days) == var.abort_incomplete_multipart_days
    error_message = "abort_incomplete_multipart_days must be a positive whole number of days."
  }
}

variable "storage_class" {
  description = "Storage class of the bucket. Exchange objects live minutes, so STANDARD (no minimum storage duration) is the only sensible class."
  type        = string
  default     = "STANDARD"

  validation {
    condition     = var.storage_class == "STANDARD"
    error_message = "storage_class must be STANDARD: the other classes bill a minimum storage duration and early deletion, and the exchange deletes objects within minutes."
  }
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete the bucket even when it still holds objects."
  type        = bool
  default     = false
}

variable "kms_key_name" {
  description = "Cloud KMS key (projects/<p>/locations/<l>/keyRings/<r>/cryptoKeys/<k>) for CMEK. Null (the default) uses Google-managed encryption. The GCS service agent needs encrypt/decrypt on the key; this module does not grant it."
  type        = string
  default     = null

  validation {
    condition     = var.kms_key_name == null || can(regex("^projects/[^/]+/locations/[^/]+/keyRings/[^/]+/cryptoKeys/[^/]+$", var.kms_key_name))
    error_message = "kms_key_name must be null or projects/<project>/locations/<location>/keyRings/<ring>/cryptoKeys/<key>."
  }
}

variable "service_account_id" {
  description = "Account ID (the part before @) of the replica service account."
  type        = string
  default     = "diloco-replica"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.service_account_id))
    error_message = "service_account_id must be 6-30 characters of lowercase letters, digits and hyphens, starting with a letter and not ending with a hyphen."
  }
}

variable "custom_role_id" {
  description = "ID of the project-level custom role holding exactly storage.objects.get/create/delete/list."
  type        = string
  default     = "dilocoReplicaObjects"

  validation {
    condition     = can(regex("^[A-Za-z0-9_.]{3,64}$", var.custom_role_id))
    error_message = "custom_role_id must be 3-64 characters of letters, digits, '_' and '.'."
  }
}

variable "restrict_to_prefix" {
  description = "Add an IAM condition to the replica and observer bindings so those service accounts can only reach objects (and list names) under the prefix. Per-run bindings (run_ids) are always conditioned on their run."
  type        = bool
  default     = true
}

variable "replica_prefix_wide" {
  description = "Bind the shared replica service account (replica_service_account) on the whole prefix, i.e. on every run. Set it to false once each run uses its own account from run_ids, so that no credential can write or delete every run."
  type        = bool
  default     = true
}

variable "run_ids" {
  description = "Run ids that get their own service account, bound on <prefix><run id>/ only (a replica of one run cannot touch another). Add a run before `diloco launch --set run_id=...`, remove it when the run is done."
  type        = set(string)
  default     = []

  validation {
    # Same pattern as diloco_serverless.config.RUN_ID_PATTERN: no '/', so no run reaches into another.
    condition     = alltrue([for run_id in var.run_ids : can(regex("^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", run_id))])
    error_message = "run_ids must be run ids: 1-128 characters of letters, digits, '.', '_' and '-', starting with a letter or digit (no '/')."
  }
}

variable "run_service_account_prefix" {
  description = "Start of the per-run service account IDs: <this>-<hash of the run id>, 30 characters in all."
  type        = string
  default     = "diloco-run"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{2,12}[a-z0-9]$", var.run_service_account_prefix))
    error_message = "run_service_account_prefix must be 4-14 characters of lowercase letters, digits and hyphens, starting with a letter and not ending with a hyphen."
  }
}

variable "observer_service_account_id" {
  description = "Account ID (the part before @) of the read-only observer service account (diloco status / logs / ls)."
  type        = string
  default     = "diloco-observer"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.observer_service_account_id))
    error_message = "observer_service_account_id must be 6-30 characters of lowercase letters, digits and hyphens, starting with a letter and not ending with a hyphen."
  }
}

variable "observer_custom_role_id" {
  description = "ID of the project-level custom role holding exactly storage.objects.get and storage.objects.list."
  type        = string
  default     = "dilocoObserverObjects"

  validation {
    condition     = can(regex("^[A-Za-z0-9_.]{3,64}$", var.observer_custom_role_id))
    error_message = "observer_custom_role_id must be 3-64 characters of letters, digits, '_' and '.'."
  }
}

variable "labels" {
  description = "Labels applied to every resource through the provider's default_labels."
  type        = map(string)
  default = {
    "managed-by" = "terraform"
    "project"    = "diloco-serverless"
  }
}
