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

override_resource {
  target = google_service_account.observer
  values = {
    email = "diloco-observer@diloco-test-project.iam.gserviceaccount.com"
  }
}

override_resource {
  target = google_project_iam_custom_role.observer
  values = {
    id = "projects/diloco-test-project/roles/dilocoObserverObjects"
  }
}

override_resource {
  target = google_service_account.run
  values = {
    email = "diloco-run@diloco-test-project.iam.gserviceaccount.com"
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
    condition     = google_storage_bucket_iam_member.replica[0].bucket == "diloco-test-exchange"
    error_message = "The role must be bound on the exchange bucket."
  }

  assert {
    condition     = google_storage_bucket_iam_member.replica[0].role == "projects/diloco-test-project/roles/dilocoReplicaObjects"
    error_message = "The binding must use the custom role."
  }

  assert {
    condition     = google_storage_bucket_iam_member.replica[0].member == "serviceAccount:diloco-replica@diloco-test-project.iam.gserviceaccount.com"
    error_message = "The binding must name the replica service account."
  }

  assert {
    condition     = strcontains(one(google_storage_bucket_iam_member.replica[0].condition).expression, "projects/_/buckets/diloco-test-exchange/objects/diloco/")
    error_message = "The binding must be conditioned on the run prefix."
  }

  assert {
    condition     = output.replica_service_account == "diloco-replica@diloco-test-project.iam.gserviceaccount.com"
    error_message = "replica_service_account must be output."
  }

  assert {
    condition     = length(google_service_account.run) == 0 && length(output.run_service_accounts) == 0
    error_message = "No per-run service account without run_ids."
  }
}

run "apply_observer_is_read_only" {
  command = apply

  assert {
    condition     = toset(google_project_iam_custom_role.observer.permissions) == toset(["storage.objects.get", "storage.objects.list"])
    error_message = "The observer role must hold exactly storage.objects.get and storage.objects.list."
  }

  assert {
    condition = [
      google_storage_bucket_iam_member.observer.bucket,
      google_storage_bucket_iam_member.observer.role,
      google_storage_bucket_iam_member.observer.member,
      ] == [
      "diloco-test-exchange",
      "projects/diloco-test-project/roles/dilocoObserverObjects",
      "serviceAccount:diloco-observer@diloco-test-project.iam.gserviceaccount.com",
    ]
    error_message = "The observer role must be bound on the exchange bucket for the observer service account."
  }

  assert {
    condition     = strcontains(one(google_storage_bucket_iam_member.observer.condition).expression, "projects/_/buckets/diloco-test-exchange/objects/diloco/")
    error_message = "The observer binding must be conditioned on the prefix."
  }

  assert {
    condition     = output.observer_service_account == "diloco-observer@diloco-test-project.iam.gserviceaccount.com" && output.observer_role_id == "projects/diloco-test-project/roles/dilocoObserverObjects"
    error_message = "observer_service_account and observer_role_id must be output."
  }
}

run "apply_per_run_service_accounts" {
  command = apply

  variables {
    run_ids             = ["run-a", "run-20261129-214455-ab12"]
    replica_prefix_wide = false
  }

  assert {
    condition     = toset(keys(google_service_account.run)) == toset(["run-a", "run-20261129-214455-ab12"])
    error_message = "Each run id gets its own service account."
  }

  assert {
    condition = alltrue([
      for run_id, account in google_service_account.run :
      account.account_id == "diloco-run-${substr(sha256(run_id), 0, 19)}" && length(account.account_id) == 30
    ])
    error_message = "Per-run account IDs are diloco-run-<19 hex of sha256(run id)>, 30 characters."
  }

  assert {
    condition = alltrue([
      for run_id, binding in google_storage_bucket_iam_member.run :
      binding.bucket == "diloco-test-exchange" && binding.role == "projects/diloco-test-project/roles/dilocoReplicaObjects"
    ])
    error_message = "Per-run bindings use the replica role on the exchange bucket."
  }

  assert {
    condition = one(google_storage_bucket_iam_member.run["run-a"].condition).expression == join(" || ", [
      "resource.name.startsWith(\"projects/_/buckets/diloco-test-exchange/objects/diloco/run-a/\")",
      "api.getAttribute(\"storage.googleapis.com/objectListPrefix\", \"\").startsWith(\"diloco/run-a/\")",
    ])
    error_message = "A per-run binding must be conditioned on <prefix><run id>/ for objects and listings."
  }

  assert {
    condition     = length(google_storage_bucket_iam_member.replica) == 0
    error_message = "replica_prefix_wide = false must drop the prefix-wide replica binding."
  }

  assert {
    condition     = toset(keys(output.run_service_accounts)) == toset(["run-a", "run-20261129-214455-ab12"])
    error_message = "run_service_accounts must map every run id to its account."
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
    condition     = length(google_storage_bucket_iam_member.replica[0].condition) == 0 && length(google_storage_bucket_iam_member.observer.condition) == 0
    error_message = "restrict_to_prefix = false must drop the IAM conditions."
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

run "rejects_run_id_with_slash" {
  command = plan

  variables {
    run_ids = ["run-a/../run-b"]
  }

  expect_failures = [var.run_ids]
}
