"""RunConfig: TOML loading, --set overrides, field-level errors, secrets refused, docs in sync."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from diloco_serverless.config import RUN_ID_PATTERN, STORE_TIMEOUT_S, RunConfig, outer_defaults
from diloco_serverless.errors import ConfigError
from support import REPO_ROOT

ROOT = REPO_ROOT


def test_defaults_are_valid_and_follow_diloco() -> None:
    cfg = RunConfig()
    assert (cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov) == outer_defaults(4, 16)  # by (N, H): measured
    assert cfg.replicas == 4 and cfg.store == "./runs" and cfg.model.name == "tiny"
    assert cfg.data.source == "stdlib"
    assert cfg.loss.alpha_sdpo > 0 and cfg.loss.beta_replay > 0  # all three channels live by default
    assert re.match(RUN_ID_PATTERN, cfg.run_id) and cfg.run_id.startswith("run-")
    assert cfg.effective_min_replicas == 4
    assert cfg.run_url == f"./runs/{cfg.run_id}"


def test_toml_sections_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        'run_id = "exp-1"\nreplicas = 2\n[inner]\nlr = 1e-4\nsync_every = 10\n[exchange]\ncodec = "bf16"\n'
    )
    cfg = RunConfig.load(
        path,
        ["inner.lr=3e-4", "exchange.error_feedback=true", "inner.betas=[0.8, 0.9]",
         "model.name=Qwen/Qwen2.5-0.5B", 'data.source="s3://b/train.jsonl"', "min_replicas=1"],
    )
    assert cfg.run_id == "exp-1" and cfg.replicas == 2 and cfg.min_replicas == 1
    assert cfg.inner.lr == 3e-4 and cfg.inner.sync_every == 10 and cfg.inner.betas == (0.8, 0.9)
    assert cfg.exchange.codec == "bf16" and cfg.exchange.error_feedback is True
    assert cfg.model.name == "Qwen/Qwen2.5-0.5B" and cfg.data.source == "s3://b/train.jsonl"
    assert RunConfig.from_toml(path).inner.lr == 1e-4


def test_json_round_trip() -> None:
    cfg = RunConfig.load(None, ["replicas=3", "exchange.codec=int8", "loss.entropy_opd_h_max=2.5"])
    data = json.loads(json.dumps(cfg.to_json_dict()))
    assert RunConfig.from_dict(data) == cfg
    assert set(data) >= {"run_id", "store", "replicas", "model", "data", "inner", "outer", "loss", "exchange"}


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("inner.lrr=1", "did you mean inner.lr"),
        ("lr=1", "inner.lr, outer.lr"),
        ("exchange.codecs=int8", "did you mean exchange.codec"),
        ("inner=3", "targets a whole section"),
        ("no_equals_sign", "key=value"),
    ],
)
def test_bad_override_keys(override: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)):
        RunConfig.load(None, [override])


@pytest.mark.parametrize(
    ("overrides", "field", "fix"),
    [
        (["replicas=0"], "replicas", "greater than or equal to 1"),
        (["min_replicas=5"], "min_replicas (5)", "replicas (4)"),
        (["exchange.codec=fp8"], "exchange.codec", "'fp32', 'bf16', 'int8' or 'sparse'"),
        (["loss.dpo_variant=ipo"], "loss.dpo_variant", "'dpo' or 'simpo'"),
        (["loss.sdpo_wrapper=x"], "loss.sdpo_wrapper", "'taid' or 'entropy_opd'"),
        (["exchange.fragments=0"], "exchange.fragments", "greater than or equal to 1"),
        (["inner.sync_every=10", "exchange.fragments=3"], "inner.sync_every (10)", "multiple of exchange.fragments"),
        (["exchange.fragment_sync_delay=16"], "fragment_sync_delay (16)", "smaller than"),
        (["data.prompt_len=128"], "data.prompt_len (128)", "smaller than data.seq_len"),
        (["data.seq_len=64", "data.prompt_len=60"], "data.prompt_len (60)", "prompt_len <= 56 or data.seq_len >= 68"),
        (["data.seq_len=abc"], "data.seq_len", "valid integer"),
        (["inner.lr=-1"], "inner.lr", "greater than 0"),
        (["loss.jsd_beta=2"], "loss.jsd_beta", "less than or equal to 1"),
        (["loss.taid_t_start=0.9", "loss.taid_t_end=0.5"], "loss.taid_t_end", ">= loss.taid_t_start"),
        (["run_id=bad/id"], "run_id", "pattern"),
        (["outer.momentum=0"], "outer.nesterov", "momentum > 0"),
    ],
)
def test_invalid_values_name_the_field(overrides: list[str], field: str, fix: str) -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.load(None, overrides)
    message = str(info.value)
    assert field in message and fix in message and "--set" in message


def test_unknown_key_in_file_names_file_and_suggestion(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[exchange]\nfragmnets = 2\n")
    with pytest.raises(ConfigError, match=r"exchange\.fragmnets.*c\.toml.*did you mean exchange\.fragments"):
        RunConfig.load(path, [])


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        RunConfig.load(tmp_path / "nope.toml", [])
    bad = tmp_path / "bad.toml"
    bad.write_text("replicas = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        RunConfig.load(bad, [])


@pytest.mark.parametrize(
    "override",
    [
        "store=s3://AKIAIOSFODNN7EXAMPLE@bucket/x",
        "store=s3://user:hunter2@minio.local/bucket",
        "model.name=hf_abcdefghijklmnopqrstuvwxyzABCDEFGH",
        "data.source=https://host/data.jsonl?X-Amz-Signature=abc",
    ],
)
def test_secret_looking_values_are_refused(override: str) -> None:
    with pytest.raises(ConfigError, match="credentials never go into the config"):
        RunConfig.load(None, [override])


def test_no_credential_fields_exist() -> None:
    names = " ".join(RunConfig.field_paths()).lower()
    for word in ("secret", "password", "token", "access_key", "credential"):
        assert word not in names


def test_compose_kwargs_passes_taid_t_only_for_taid() -> None:
    cfg = RunConfig.load(None, ["loss.sdpo_wrapper=taid"])
    assert cfg.loss.compose_kwargs(taid_t=0.5)["taid_t"] == 0.5
    assert RunConfig().loss.compose_kwargs(taid_t=0.5)["taid_t"] is None
    assert RunConfig().loss.needs_reference
    assert not RunConfig.load(None, ["loss.dpo_variant=simpo"]).loss.needs_reference
    assert not RunConfig.load(None, ["loss.beta_replay=0"]).loss.needs_reference


def test_examples_load() -> None:
    examples = sorted((ROOT / "examples").glob("*.toml"))
    assert examples, "examples/*.toml missing"
    for path in examples:
        RunConfig.from_toml(path)


def test_docs_list_every_field() -> None:
    doc = (ROOT / "docs" / "config.md").read_text()
    missing = [p for p in RunConfig.field_paths() if f"`{p}`" not in doc]
    assert not missing, f"docs/config.md lacks {missing}"


def test_none_unsets_optional_fields() -> None:
    cfg = RunConfig.load(None, ["min_replicas=2", "min_replicas=none", "exchange.keep_rounds=null"])
    assert cfg.min_replicas is None and cfg.exchange.keep_rounds is None
    assert RunConfig.load(None, ["model.name=none"]).model.name == "none"  # not optional: stays a string


def test_with_overrides_applies_on_top_of_the_object_not_the_defaults() -> None:
    base = RunConfig.load(None, ["run_id=exp-7", "replicas=8", "inner.lr=0.01", "min_replicas=none"])
    cfg = base.with_overrides(["min_replicas=6", "rounds=2", "exchange.codec=bf16"])
    # min_replicas=6 validates against the object's replicas=8, not the default 4
    assert (cfg.run_id, cfg.replicas, cfg.min_replicas, cfg.rounds) == ("exp-7", 8, 6, 2)
    assert cfg.inner.lr == 0.01 and cfg.exchange.codec == "bf16"
    assert (base.min_replicas, base.rounds, base.exchange.codec) == (None, 10, "fp32")  # base untouched
    assert cfg.with_overrides(["min_replicas=null"]).min_replicas is None
    same = base.with_overrides([])
    assert same == base and same is not base


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["inner.lrr=1"], "unknown config key 'inner.lrr' (from --set); did you mean inner.lr"),
        (["inner=3"], "targets a whole section"),
        (["no_equals_sign"], "must look like key=value"),
        (["min_replicas=9"], "min_replicas (9) must be <= replicas (8)"),
        (["exchange.codec=fp8"], "invalid config (from config + --set exchange.codec=fp8)"),
    ],
)
def test_with_overrides_errors_match_load(overrides: list[str], expected: str) -> None:
    base = RunConfig.load(None, ["replicas=8"])
    with pytest.raises(ConfigError, match=re.escape(expected)) as from_object:
        base.with_overrides(overrides)
    with pytest.raises(ConfigError) as from_load:  # RunConfig.load says the same for the same input
        RunConfig.load(None, ["replicas=8", *overrides])
    assert _without_source(str(from_object.value)) == _without_source(str(from_load.value))
    with pytest.raises(TypeError, match="list of 'key=value'"):
        base.with_overrides("rounds=2")  # type: ignore[arg-type]


def _without_source(message: str) -> str:
    """A ConfigError message minus its "(from <source>)" part, which differs by entry point."""
    return re.sub(r"\(from [^)]*\)", "(from ...)", message)


# ------------------------------------------------------------------------------------ secrets: kinds, never values
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
SECRETS = [
    ("model.revision", AWS_SECRET, "an AWS secret access key"),
    ("data.source", f"https://host/d.jsonl?aws_secret_access_key={AWS_SECRET}", "an AWS secret access key"),
    ("data.source", "https://storage.googleapis.com/b/d.jsonl?X-Goog-Algorithm=x&X-Goog-Signature=0a1b2c",
     "a signed URL credential"),
    ("data.source", "https://b.s3.amazonaws.com/d.jsonl?Expires=1700000000&Signature=dGhpcyBpcyBzaWc%3D",
     "an S3 SigV2 signed URL"),
    ("data.source", "HTTPS://alice:hunter2@example.com/d.jsonl", "a password in a URL"),
    ("store", "S3://alice:hunter2@minio.local/bucket", "a password in a URL"),
    *[("model.name", f"{prefix}_{'A1b2C3d4E5' * 3}f6G7h8", "a GitHub token")  # 36 characters, as GitHub's
      for prefix in ("ghp", "gho", "ghu", "ghs", "ghr")],
    ("model.name", "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTU",
     "a GitHub token"),
    ("model.name", JWT, "a JSON Web Token"),
    ("model.name", "hf_abcdefghijklmnopqrstuvwxyzABCDEFGH", "a Hugging Face token"),
]


@pytest.mark.parametrize("field,value,kind", SECRETS, ids=[f"{k} in {f}" for f, _, k in SECRETS])
def test_each_secret_kind_is_refused_by_field_and_kind_without_echoing_it(field: str, value: str, kind: str) -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.load(None, [f"{field}={json.dumps(value)}"])
    message = str(info.value)
    assert f"{field} looks like it contains {kind}" in message
    assert value not in message and value[:16] not in message, message


def test_secret_in_a_value_of_the_wrong_type_is_not_echoed() -> None:
    """The type error quotes the input ("got ..."): never when it is a secret."""
    with pytest.raises(ConfigError, match=r"replicas: .*\(got <a value that looks like a GitHub token, not shown>\)"
                       ) as info:
        RunConfig.load(None, ["replicas=ghp_" + "a1B2" * 10])
    assert "a1B2a1B2" not in str(info.value)
    with pytest.raises(ConfigError, match="unknown config key <a value that looks like a JSON Web Token") as info:
        RunConfig.load(None, [f"{JWT}=1"])
    assert JWT[:20] not in str(info.value)


def test_secret_in_a_toml_file_is_refused_without_echoing_it(tmp_path: Path) -> None:
    path = tmp_path / "leaky.toml"
    path.write_text(f'replicas = "{AWS_SECRET}"\n[model]\nname = "{AWS_SECRET}"\n')
    with pytest.raises(ConfigError) as info:
        RunConfig.load(path, [])
    message = str(info.value)
    assert str(path) in message and "an AWS secret access key" in message
    assert "replicas" in message and AWS_SECRET not in message and AWS_SECRET[:16] not in message


@pytest.mark.parametrize("field,value", [
    ("model.revision", "da39a3ee5e6b4b0d3255bfef95601890afd80709"),  # a git commit / sha1 hex digest
    ("model.revision", "DA39A3EE5E6B4B0D3255BFEF95601890AFD80709"),
    ("model.name", "meta-llama/Llama-3.1-8B-Instruct"),
    ("data.source", "/home/alice/Datasets2024/train/v3/part1/all"),  # a path: more than two '/'
    ("data.source", "https://huggingface.co/datasets/x/resolve/main/d.jsonl?download=true"),
    ("store", "s3://bucket/prefix/runs"),
    ("run_id", "run-20261129-214455-ab12"),
])
def test_ordinary_values_are_not_mistaken_for_secrets(field: str, value: str) -> None:
    cfg = RunConfig.load(None, [f"{field}={json.dumps(value)}"])
    assert cfg.model_dump()[field.split(".")[0]] is not None


def test_store_timeout_s_default_and_validation() -> None:
    assert RunConfig().store_timeout_s == STORE_TIMEOUT_S == 60.0
    assert RunConfig.load(None, ["store_timeout_s=5"]).store_timeout_s == 5.0
    assert RunConfig.from_dict({"store_timeout_s": 0.5}).to_json_dict()["store_timeout_s"] == 0.5
    for bad in ("0", "-3", "inf", "nan", '"soon"'):
        with pytest.raises(ConfigError, match="store_timeout_s"):
            RunConfig.load(None, [f"store_timeout_s={bad}"])
    # a run.json written before the field existed still loads, with the default
    old = RunConfig().to_json_dict()
    del old["store_timeout_s"]
    assert RunConfig.from_dict(old).store_timeout_s == STORE_TIMEOUT_S


# ------------------------------------------------------------------------------------ [tracking] and [hub]
def test_tracking_and_hub_defaults_are_off() -> None:
    cfg = RunConfig()
    assert cfg.tracking.backends == [] and cfg.tracking.project == "diloco" and not cfg.tracking.per_replica
    assert cfg.hub.repo_id is None and cfg.hub.private is True
    old = cfg.to_json_dict()  # a run.json written before the sections existed still loads
    del old["tracking"], old["hub"]
    assert RunConfig.from_dict(old) == cfg


def test_tracking_backends_from_toml_lists_and_comma_separated_set() -> None:
    assert RunConfig.load(None, ['tracking.backends=["wandb", "trackio"]']).tracking.backends == ["wandb", "trackio"]
    assert RunConfig.load(None, ["tracking.backends=tensorboard,wandb"]).tracking.backends == ["tensorboard", "wandb"]
    assert RunConfig.load(None, ["tracking.backends=trackio"]).tracking.backends == ["trackio"]


@pytest.mark.parametrize("override,message", [
    ("tracking.backends=mlflow", "Input should be 'trackio', 'wandb' or 'tensorboard'"),
    ("tracking.backends=wandb,wandb", "names a backend twice"),
    ('tracking.project=" "', "tracking.project: must not be empty"),
    ("hub.repo_id=just-a-name", 'hub.repo_id: must be a Hub model repository "ORG/NAME"'),
    ("hub.repo_id=a/b/c", 'must be a Hub model repository "ORG/NAME"'),
    ("hub.repo_id=org/-name", 'must be a Hub model repository "ORG/NAME"'),
    ("hub.repo_id=org/na--me", 'must be a Hub model repository "ORG/NAME"'),
    ("hub.repo_id=hf_" + "a" * 34 + "/x", "credentials never go into the config"),
])
def test_tracking_and_hub_errors(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        RunConfig.load(None, [override])


def test_hub_repo_id_accepts_org_slash_name() -> None:
    for repo in ("my-org/smollm2-diloco", "user/Model_v1.2", "a/b"):
        assert RunConfig.load(None, [f"hub.repo_id={repo}"]).hub.repo_id == repo


def test_fsdp_strategy_needs_two_devices() -> None:
    cfg = RunConfig.load(None, ["parallel.devices=2", "parallel.strategy=fsdp"])
    assert cfg.parallel.strategy == "fsdp" and cfg.parallel.devices == 2
    with pytest.raises(ValueError, match=r"strategy 'fsdp' shards the model.*devices=1.*parallel.devices to 2"):
        RunConfig.load(None, ["parallel.strategy=fsdp"])
