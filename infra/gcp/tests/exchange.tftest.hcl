# `terraform test` for the GCP exchange module. Runs offline: the provider is mocked, so no
# credentials are needed and nothing is created. Run from infra/gcp: terraform init && terraform test

mock_provider "google" {
  mock_resource "google_service_account" {
    defaults = {
      email = "diloco-replica@diloco-test-project.iam.gserviceaccount.com"
    }
  }

  mock_resource "google_project_iam_custom_role" {
    defaults = {
      id = "projects/diloco-test-project/roles/dilocoReplicaObjects"
    }
  }
}

variables {
  project_id      = "diloco-test-project"
  bucket_name     = "diloco-test-exchange"
  location        = "us-central1"
  prefix          = "diloco/"
  expiration_days = 7
}

run "plan_secure_bucket" {
  command = plan

  assert {
    condition     = google_storage_bucket.exchange.uniform_bucket_level_access == true
    error_message = "Uniform bucket-level access must be on."
  }

  assert {
    condition     = google_storage_bucket.exchange.public_access_prevention == "enforced"
    error_message = "Public access prevention must be enforced."
  }

  assert {
    condition     = one(google_storage_bucket.exchange.soft_delete_policy).retention_duration_seconds == 0
    error_message = "Soft delete must be off for throwaway tensors."
  }

  assert {
    condition     = google_storage_bucket.exchange.force_destroy == false
    error_message = "force_destroy must default to false."
  }

  assert {
    condition = [
      for r in google_storage_bucket.exchange.lifecycle_rule :
      [one(r.condition).age, one(r.condition).matches_prefix]
      if one(r.action).type == "Delete"
    ] == [[7, tolist(["diloco/"])]]
    error_message = "Exactly one lifecycle rule must delete the prefix after expiration_days."
  }

  assert {
    condition = length([
      for r in google_storage_bucket.exchange.lifecycle_rule : r
      if one(r.action).type == "AbortIncompleteMultipartUpload"
    ]) == 1
    error_message = "A lifecycle rule must abort incomplete multipart uploads."
  }

  assert {
    condition     = length(google_storage_bucket.exchange.encryption) == 0
    error_message = "Without kms_key_name the bucket uses Google-managed encryption."
  }

  assert {
    condition     = output.exchange_url == "gs://diloco-test-exchange/diloco/"
    error_message = "exchange_url must be gs://<bucket>/<prefix>."
  }

  assert {
    condition     = output.expiration_days == 7 && output.location == "us-central1" && output.bucket == "diloco-test-exchange"
    error_message = "Outputs the CLI reads must echo the inputs."
  }
}

run "apply_replica_access_is_least_privilege" {
  command = apply

  assert {
    condition = toset(google_project_iam_custom_role.replica.permissions) == toset([
      "storage.objects.get", "storage.objects.create", "storage.objects.delete", "storage.objects.list",
    ])
    error_message = "The custom role must hold exactly storage.objects.get/create/delete/list."
  }

  assert {
    condition     = google_storage_bucket_iam_member.replica.bucket == "diloco-test-exchange"
    error_message = "The role must be bound on the exchange bucket."
  }

  assert {
    condition     = google_storage_bucket_iam_member.replica.role == "projects/diloco-test-project/roles/dilocoReplicaObjects"
    error_message = "The binding must use the custom role."
  }

  assert {
    condition     = google_storage_bucket_iam_member.replica.member == "serviceAccount:diloco-replica@diloco-test-project.iam.gserviceaccount.com"
    error_message = "The binding must name the replica service account."
  }

  assert {
    condition     = strcontains(one(google_storage_bucket_iam_member.replica.condition).expression, "projects/_/buckets/diloco-test-exchange/objects/diloco/")
    error_message = "The binding must be conditioned on the run prefix."
  }

  assert {
    condition     = output.replica_service_account == "diloco-replica@diloco-test-project.iam.gserviceaccount.com"
    error_message = "replica_service_account must be output."
  }
}

run "apply_with_cmek_and_no_prefix_condition" {
  command = apply

  variables {
    kms_key_name       = "projects/diloco-test-project/locations/us-central1/keyRings/diloco/cryptoKeys/exchange"
    restrict_to_prefix = false
    force_destroy      = true
  }

  assert {
    condition     = one(google_storage_bucket.exchange.encryption).default_kms_key_name == "projects/diloco-test-project/locations/us-central1/keyRings/diloco/cryptoKeys/exchange"
    error_message = "kms_key_name must switch the bucket to CMEK."
  }

  assert {
    condition     = length(google_storage_bucket_iam_member.replica.condition) == 0
    error_message = "restrict_to_prefix = false must drop the IAM condition."
  }

  assert {
    condition     = google_storage_bucket.exchange.force_destroy == true
    error_message = "force_destroy must follow its variable."
  }
}

run "rejects_prefix_without_trailing_slash" {
  command = plan

  variables {
    prefix = "diloco"
  }

  expect_failures = [var.prefix]
}

run "rejects_zero_expiration_days" {
  command = plan

  variables {
    expiration_days = 0
  }

  expect_failures = [var.expiration_days]
}

run "rejects_invalid_bucket_name" {
  command = plan

  variables {
    bucket_name = "Diloco_Exchange"
  }

  expect_failures = [var.bucket_name]
}

run "rejects_bucket_name_with_google" {
  command = plan

  variables {
    bucket_name = "my-google-exchange"
  }

  expect_failures = [var.bucket_name]
}

run "rejects_project_number_as_project_id" {
  command = plan

  variables {
    project_id = "123456789012"
  }

  expect_failures = [var.project_id]
}
