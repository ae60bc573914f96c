variable "bucket_name" {
  description = "Name of the S3 bucket the replicas exchange pseudo-gradients through. Globally unique, 3-63 characters of lowercase letters, digits, hyphens and dots."
  type        = string

  validation {
    condition = alltrue([
      can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket_name)),
      !strcontains(var.bucket_name, ".."),
      !can(regex("^[0-9]+\\.[0-9]+\\.[0-9]+\\.[0-9]+$", var.bucket_name)),
      !startswith(var.bucket_name, "xn--"),
      !startswith(var.bucket_name, "sthree-"),
      !endswith(var.bucket_name, "-s3alias"),
      !endswith(var.bucket_name, "--ol-s3"),
    ])
    error_message = "bucket_name must be 3-63 characters of lowercase letters, digits, '.' and '-', start and end with a letter or digit, contain no '..', not look like an IP address, and not use the reserved prefixes xn--/sthree- or suffixes -s3alias/--ol-s3."
  }
}

variable "region" {
  description = "AWS region of the bucket. Put it next to the GPUs (Modal and Hugging Face Jobs run mostly in us-east-1)."
  type        = string
  default     = "us-east-1"

  validation {
    condition     = can(regex("^[a-z]{2}(-[a-z]+)+-[0-9]+$", var.region))
    error_message = "region must be an AWS region name such as us-east-1 or eu-west-2."
  }
}

variable "prefix" {
  description = "Key prefix under which runs live; the exchange URL is s3://<bucket>/<prefix>. Must end with '/'. Replicas may touch nothing outside it."
  type        = string
  default     = "diloco/"

  validation {
    condition     = can(regex("^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*/$", var.prefix))
    error_message = "prefix must be one or more '/'-separated segments of letters, digits, '.', '_' or '-', must not start with '/', and must end with '/' (for example \"diloco/\"). Wildcards are refused because the prefix is used in IAM resource ARNs."
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
  description = "Days after which incomplete multipart uploads anywhere in the bucket are aborted (their parts are billed until then)."
  type        = number
  default     = 1

  validation {
    condition     = var.abort_incomplete_multipart_days > 0 && floor(var.abort_incomplete_multipart_days) == var.abort_incomplete_multipart_days
    error_message = "abort_incomplete_multipart_days must be a positive whole number of days."
  }
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete the bucket even when it still holds objects."
  type        = bool
  default     = false
}

variable "kms_key_arn" {
  description = "ARN of a customer-managed KMS key for SSE-KMS. Null (the default) encrypts with S3-managed keys (SSE-S3, AES256). Replicas then also need kms:Decrypt/GenerateDataKey on that key, which this module does not grant."
  type        = string
  default     = null

  validation {
    condition     = var.kms_key_arn == null || can(regex("^arn:aws[a-z-]*:kms:[a-z0-9-]+:[0-9]{12}:(key|alias)/.+$", var.kms_key_arn))
    error_message = "kms_key_arn must be null or a KMS key/alias ARN (arn:aws:kms:<region>:<account>:key/<id>)."
  }
}

variable "replica_policy_name" {
  description = "Name of the IAM policy granting replicas access to the prefix. Null derives it from the bucket name."
  type        = string
  default     = null

  validation {
    condition     = var.replica_policy_name == null || can(regex("^[A-Za-z0-9+=,.@_-]{1,128}$", var.replica_policy_name))
    error_message = "replica_policy_name must be 1-128 characters of letters, digits and +=,.@_-."
  }
}

variable "replica_role_trusted_principals" {
  description = "IAM principal ARNs (roles, users or account roots) allowed to assume the replica role. Empty (the default) creates no role: attach the policy to an identity you manage instead."
  type        = list(string)
  default     = []

  validation {
    condition = alltrue([
      for p in var.replica_role_trusted_principals :
      can(regex("^arn:aws[a-z-]*:iam::[0-9]{12}:(root|role/.+|user/.+)$", p))
    ])
    error_message = "replica_role_trusted_principals must be IAM ARNs of the form arn:aws:iam::<12-digit account>:root, :role/<name> or :user/<name>; wildcards are not accepted."
  }
}

variable "replica_role_name" {
  description = "Name of the optional replica role. Null derives it from the bucket name."
  type        = string
  default     = null

  validation {
    condition     = var.replica_role_name == null || can(regex("^[A-Za-z0-9+=,.@_-]{1,64}$", var.replica_role_name))
    error_message = "replica_role_name must be 1-64 characters of letters, digits and +=,.@_-."
  }
}

variable "replica_role_external_id" {
  description = "sts:ExternalId the trusted principals must pass when assuming the replica role. Required (16-1224 characters) whenever replica_role_trusted_principals is set, for a principal in this account as much as in another: a launcher service acting for several teams cannot then be tricked into fetching this role's credentials for someone else (confused deputy). Treat it like a password-grade random string (`openssl rand -hex 16`)."
  type        = string
  default     = null
  sensitive   = true

  validation {
    # coalesce: HCL evaluates every operand, and length(null) is an error.
    condition = var.replica_role_external_id == null || alltrue([
      can(regex("^[A-Za-z0-9+=,.@:/-]+$", coalesce(var.replica_role_external_id, "unset"))),
      length(coalesce(var.replica_role_external_id, "unset")) >= 16,
      length(coalesce(var.replica_role_external_id, "unset")) <= 1224,
    ])
    error_message = "replica_role_external_id must be 16-1224 characters of letters, digits and +=,.@:/- (a random string, e.g. `openssl rand -hex 16`)."
  }
}

variable "replica_role_max_session_s" {
  description = "Maximum session duration of the replica role, in seconds (3600-43200, default 1 h). A leaked session stops working when it expires; raise it only for runs that cannot refresh their credentials, and pass the same --duration-seconds to sts:AssumeRole."
  type        = number
  default     = 3600

  validation {
    condition     = var.replica_role_max_session_s >= 3600 && var.replica_role_max_session_s <= 43200 && floor(var.replica_role_max_session_s) == var.replica_role_max_session_s
    error_message = "replica_role_max_session_s must be a whole number of seconds between 3600 and 43200."
  }
}

variable "observer_policy_name" {
  description = "Name of the read-only IAM policy for observers (diloco status / logs / ls). Null derives it from the bucket name."
  type        = string
  default     = null

  validation {
    condition     = var.observer_policy_name == null || can(regex("^[A-Za-z0-9+=,.@_-]{1,128}$", var.observer_policy_name))
    error_message = "observer_policy_name must be 1-128 characters of letters, digits and +=,.@_-."
  }
}

variable "observer_role_trusted_principals" {
  description = "IAM principal ARNs allowed to assume the read-only observer role. Empty (the default) creates no role: attach observer_policy_arn to an identity you manage instead."
  type        = list(string)
  default     = []

  validation {
    condition = alltrue([
      for p in var.observer_role_trusted_principals :
      can(regex("^arn:aws[a-z-]*:iam::[0-9]{12}:(root|role/.+|user/.+)$", p))
    ])
    error_message = "observer_role_trusted_principals must be IAM ARNs of the form arn:aws:iam::<12-digit account>:root, :role/<name> or :user/<name>; wildcards are not accepted."
  }
}

variable "observer_role_name" {
  description = "Name of the optional observer role. Null derives it from the bucket name."
  type        = string
  default     = null

  validation {
    condition     = var.observer_role_name == null || can(regex("^[A-Za-z0-9+=,.@_-]{1,64}$", var.observer_role_name))
    error_message = "observer_role_name must be 1-64 characters of letters, digits and +=,.@_-."
  }
}

variable "observer_role_external_id" {
  description = "sts:ExternalId the trusted principals must pass when assuming the observer role. Required (16-1224 characters) whenever observer_role_trusted_principals is set."
  type        = string
  default     = null
  sensitive   = true

  validation {
    condition = var.observer_role_external_id == null || alltrue([
      can(regex("^[A-Za-z0-9+=,.@:/-]+$", coalesce(var.observer_role_external_id, "unset"))),
      length(coalesce(var.observer_role_external_id, "unset")) >= 16,
      length(coalesce(var.observer_role_external_id, "unset")) <= 1224,
    ])
    error_message = "observer_role_external_id must be 16-1224 characters of letters, digits and +=,.@:/-."
  }
}

variable "tags" {
  description = "Tags applied to every resource through the provider's default_tags. Must not hold the run tag key diloco-run-id: a role tag with that key would stand in for a missing session tag and scope sessions to that run."
  type        = map(string)
  default = {
    "managed-by" = "terraform"
    "project"    = "diloco-serverless"
  }

  validation {
    condition     = !contains([for k in keys(var.tags) : lower(k)], "diloco-run-id")
    error_message = "tags must not contain the key diloco-run-id (in any case): it is the per-session run tag."
  }
}
