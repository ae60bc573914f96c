"""Push a finished run's model to the Hugging Face Hub: ``final/`` plus a model card and the loss plot.

::

    run.push_to_hub("my-org/smollm2-diloco")       # Run.push_to_hub -> push_final(...)
    diloco push RUN my-org/smollm2-diloco          # the same from the shell
    diloco launch ... --push-to-hub my-org/x       # after the run succeeds (hub.repo_id)

Only a run that **succeeded** is pushed, and only when its ``final/`` is complete (``final/DONE.json``,
written after the last file, signed with the run key: :mod:`diloco_serverless.run.final`); anything
else is refused with a :class:`LaunchError` saying why. Exactly the files DONE.json lists (the
``save_pretrained`` folder: config, safetensors, tokenizer) are copied from the store, each checked
against the SHA-256 it lists, into a temporary folder with a ``README.md`` model card (base model, data, config, rounds,
tokens, bytes moved, final eval loss) and ``loss.png`` (:func:`plot_losses`), then
``HfApi.create_repo`` (private by default, ``exist_ok``) and one ``HfApi.upload_folder`` commit.

The token is the Hub's own: ``HF_TOKEN`` or the ``hf auth login`` file, read by
``huggingface_hub.get_token()`` on this machine; it is never read from, or written to, the store or
run.json. ``huggingface_hub`` is the ``hf`` extra, imported only here, inside the functions.
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from diloco_serverless.config import HF_SOURCE_PREFIX, RunConfig
from diloco_serverless.errors import LaunchError, one_line
from diloco_serverless.launcher.plot import Metrics, as_number, plot_losses
from diloco_serverless.launcher.status import SUCCEEDED, RunStatus
from diloco_serverless.run.final import InvalidFinal, read_done
from diloco_serverless.run.layout import FINAL_PREFIX
from diloco_serverless.run.rl_metrics import per_function, rl_rounds
from diloco_serverless.store.errors import ObjectNotFound
from diloco_serverless.store.objectstore import ObjectStore

#: Written by the replica that saves the final model (trainer/checkpoint.py): the lock it took and the
#: marker it writes after the last file. Bookkeeping of the run, not part of the model: never pushed.
FINAL_DONE = f"{FINAL_PREFIX}/DONE.json"
_BOOKKEEPING = frozenset({"LOCK.json", "DONE.json"})
#: Config keys left out of the model card: where the run's bucket is says nothing about the model.
_CARD_OMITS = ("store",)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_URL = "https://huggingface.co"


def _hf() -> Any:
    try:
        import huggingface_hub
    except ImportError:
        raise LaunchError("pushing to the Hub needs huggingface_hub: pip install 'diloco-serverless[hf]'") from None
    return huggingface_hub


def hub_token() -> str | None:
    """The Hub token of this machine (``HF_TOKEN``, else the ``hf auth login`` file), or None."""
    token = _hf().get_token()
    return token if isinstance(token, str) and token else None


def check_push_ready(repo_id: str) -> None:
    """LaunchError unless a push to ``repo_id`` could start from here: huggingface_hub installed and a
    token available. ``diloco launch --push-to-hub`` runs it before creating the run."""
    if hub_token() is None:
        raise LaunchError(
            f"--push-to-hub {repo_id} needs a Hugging Face token with write access: run `hf auth login` or "
            "export HF_TOKEN (it is read here, never stored with the run)"
        )


def check_pushable(status: RunStatus, store: ObjectStore, run_key: bytes | None = None) -> dict[str, str]:
    """LaunchError unless the run succeeded and its ``final/`` is complete: a ``final/DONE.json`` signed with
    ``run_key`` (the launcher's copy of the run key; without it nothing can be verified and the file list is
    taken as it is). Returns the files it lists (key -> SHA-256)."""
    if status.state != SUCCEEDED:
        why = "; ".join(f"rank {r}: {one_line(w)}" for r, w in status.failures)
        hint = ("wait for it to finish (diloco status --watch) and push then" if not status.done
                else "only a run that succeeded has a final model to push")
        raise LaunchError(f"run {status.run_id} is {status.state}, not succeeded{f' ({why})' if why else ''}: "
                          f"refusing to push it; {hint}")
    try:
        files = read_done(store, run_key)
    except InvalidFinal as e:
        raise LaunchError(f"run {status.run_id}: {e}; refusing to push it") from e
    if files is None:
        raise LaunchError(f"run {status.run_id} has no complete final model ({store.url}/{FINAL_DONE} is missing): "
                          "refusing to push it")
    return files


def _safe_relative(key: str) -> PurePosixPath | None:
    """``final/<rel>`` as a relative path inside the upload folder, or None (bookkeeping, or a key that
    would leave the folder: keys come from the bucket)."""
    rel = PurePosixPath(key[len(FINAL_PREFIX) + 1:])
    if not rel.parts or rel.is_absolute() or any(p in ("", ".", "..") for p in rel.parts):
        return None
    if len(rel.parts) == 1 and rel.name in _BOOKKEEPING:
        return None
    return rel


def download_final(store: ObjectStore, dest: Path, listed: Mapping[str, str] | None = None) -> list[str]:
    """Copy the model files of ``final/`` into ``dest``; return their relative paths. With ``listed`` (the
    signed ``final/DONE.json``: key -> SHA-256), exactly those files, each checked against its SHA-256
    (LaunchError naming a file that is missing or differs); anything else under ``final/`` is left."""
    files: list[str] = []
    keys = sorted(listed) if listed is not None else sorted(store.list(FINAL_PREFIX + "/"))
    for key in keys:
        rel = _safe_relative(key)
        if rel is None:
            continue
        try:
            data = store.get(key)
        except ObjectNotFound:
            raise LaunchError(f"{store.url}/{key}, listed in {FINAL_DONE}, is missing; refusing to push") from None
        if listed is not None and hashlib.sha256(data).hexdigest() != listed[key]:
            raise LaunchError(f"{store.url}/{key} is not the file {FINAL_DONE} lists (its SHA-256 differs): it was "
                              "replaced after the run wrote it; refusing to push")
        target = dest.joinpath(*rel.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        files.append(str(rel))
    if not files:
        raise LaunchError(f"{store.url}/{FINAL_PREFIX}/ holds no model files to push")
    return files


def tokens_trained(metrics: Metrics) -> int:
    """Tokens every replica trained on, over all rounds (the metrics' ``tokens``, summed)."""
    total = 0.0
    for records in metrics.values():
        for rec in records:
            value = as_number(rec.get("tokens")) if isinstance(rec, Mapping) else None
            if value is not None and value > 0:
                total += value
    return int(total)


def _bytes(n: float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover - the loop always returns


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _md(value: Any) -> str:
    """A value as text inside a markdown table cell: no line breaks, no pipes."""
    return str(value).replace("\n", " ").replace("|", "\\|")


def base_model_id(cfg: RunConfig) -> str | None:
    """``model.name`` when it is a Hub model id (not "tiny", not a folder on this machine), else None."""
    name = cfg.model.name
    if name == "tiny" or not _HUB_ID.match(name) or Path(name).expanduser().exists():
        return None
    return name


def rl_rows(cfg: RunConfig, rounds: Mapping[int, Mapping[str, float]]) -> list[tuple[str, str]]:
    """The model card's rows for an RL run (``loss.channel1`` grpo / dppo): the loss and its rewards, the
    reward of the first and last round with RL numbers, and the last round's completion length, KL,
    entropy, clip fraction and generation share (each averaged over the replicas); none for a supervised run."""
    if cfg.loss.channel1 == "lm":
        return []
    rl = cfg.rl
    loss = f"{cfg.loss.channel1} ({rl.loss_type})" if cfg.loss.channel1 == "grpo" else cfg.loss.channel1
    funcs = ", ".join(f"`{_md(f)}`" for f in rl.reward_funcs)
    rows = [("channel 1 (RL)", f"{loss}, G = {rl.num_generations} completions per prompt, "
                               f"at most {rl.max_completion_length} tokens; rewards {funcs}")]
    if not rounds:
        return rows
    first, last = min(rounds), max(rounds)
    a, b = rounds[first], rounds[last]

    def reward(summary: Mapping[str, float]) -> str:
        mean, std = summary.get("reward_mean"), summary.get("reward_std")
        return "-" if mean is None else f"{mean:.4f}" + ("" if std is None else f" ± {std:.4f}")

    def num(key: str, fmt: str, scale: float = 1.0, unit: str = "") -> str:
        return "-" if b.get(key) is None else f"{format(scale * b[key], fmt)}{unit}"

    rows += [
        ("reward (mean over replicas)", f"{reward(a)} in round {first} → {reward(b)} in round {last}"),
        *((f"reward `{_md(name)}`", f"{mean:.4f}" + ("" if std is None else f" ± {std:.4f}") + f" (round {last})")
          for name, (mean, std) in per_function(b).items()),
        ("completion length", num("completion_length", ".1f", unit=" tokens")),
        ("KL to the initial model", num("rl_kl", ".4g")),
        ("entropy", num("rl_entropy", ".4f")),
        ("clip fraction", num("rl_clip_fraction", ".2f", 100.0, "%")),
        ("generation share of a round", num("generation_share", ".1f", 100.0, "%")),
    ]
    return rows


def model_card(*, repo_id: str, cfg: RunConfig, status: RunStatus, tokens: int, has_plot: bool,
               rl: Mapping[int, Mapping[str, float]] | None = None) -> str:
    """The ``README.md`` pushed with the model: Hub metadata, what was trained on what, the run's
    numbers (an RL run's rewards, completion length, KL... from ``rl``, :func:`rl_rounds` of its
    metrics), the loss plot, the config, and how to load it."""
    base = base_model_id(cfg)
    data = cfg.data
    dataset = data.source[len(HF_SOURCE_PREFIX):] if data.source.startswith(HF_SOURCE_PREFIX) else None
    meta = ["library_name: transformers", "pipeline_tag: text-generation"]
    if base is not None:
        meta.append(f"base_model: {json.dumps(base)}")
    if dataset is not None:
        meta += ["datasets:", f"- {json.dumps(dataset)}"]
    meta += ["tags:", "- diloco", "- diloco-serverless"]
    if cfg.model.name == "tiny":
        model_line = "`tiny` (a ~1M-parameter Qwen2 with a byte-level tokenizer, random init)"
    elif base is not None:
        rev = f" @ `{cfg.model.revision}`" if cfg.model.revision else ""
        model_line = f"[`{base}`]({HUB_URL}/{base}){rev}"
    else:
        model_line = f"`{_md(cfg.model.name)}` (a local folder)"
    if cfg.data.source == "stdlib":
        data_line = "`stdlib` (the Python standard library's own source)"
    else:
        source = f"[`{dataset}`]({HUB_URL}/datasets/{dataset})" if dataset else f"`{_md(data.source)}`"
        extras = [f"format `{data.format}`"] + [f"{k} `{_md(v)}`" for k, v in (
            ("config", data.config), ("split", data.split), ("revision", data.revision)) if v]
        data_line = f"{source} ({', '.join(extras)})"
    rounds = "-" if status.round is None else str(min(status.round, cfg.rounds))
    rows = [
        ("base model", model_line),
        ("data", data_line),
        ("replicas", f"{cfg.replicas} ({status.executor or '?'}{f', {status.gpu}' if status.gpu else ''})"),
        ("rounds", f"{rounds}/{cfg.rounds} (H = {cfg.inner.sync_every} inner steps each)"),
        ("tokens trained", f"{tokens:,}"),
        ("bytes moved through the store", _bytes(status.bytes_moved)),
        ("final eval loss", "-" if status.eval_loss is None else f"{status.eval_loss:.4f}"
         + (" (minus the mean reward on held-out prompts)" if cfg.loss.channel1 != "lm" else "")),
        ("final train loss",
         "-" if status.loss is None else f"{status.loss:.4f} (compose_loss total, mean over replicas)"),
        ("wall time", _duration(status.elapsed_s)),
        ("run", f"`{_md(cfg.run_id)}`"),
        *rl_rows(cfg, rl or {}),
    ]
    shown = {k: v for k, v in cfg.to_json_dict().items() if k not in _CARD_OMITS}
    lines = [
        "---", *meta, "---", "",
        f"# {repo_id.split('/', 1)[1]}", "",
        f"Trained with diloco-serverless: DiLoCo across {cfg.replicas} replicas that average "
        "their pseudo-gradients through an object store every "
        f"{cfg.inner.sync_every} inner steps (outer {'Nesterov ' if cfg.outer.nesterov else ''}SGD, lr {cfg.outer.lr}, "
        f"momentum {cfg.outer.momentum}).",
        "",
        "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), "",
    ]
    if has_plot:
        lines += ["![Training loss per replica and eval loss per round](loss.png)", ""]
    lines += [
        "## Use", "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")',
        "```", "",
        "## Config", "",
        "The run's `RunConfig` (its `run.json`; the store URL left out):", "",
        "```json", json.dumps(shown, indent=2, sort_keys=True), "```", "",
    ]
    return "\n".join(lines)


def push_final(store: ObjectStore, cfg: RunConfig, status: RunStatus, metrics: Metrics, repo_id: str, *,
               private: bool = True, api: Any = None, run_key: bytes | None = None) -> str:
    """Push the run's ``final/`` with a model card and loss plot to ``repo_id``; return the repo URL.

    ``store`` is the run's store (``<store>/<run_id>``); ``api`` an ``HfApi``-like object (default:
    ``HfApi(token=<this machine's token>)``). LaunchError when the run did not succeed, has no complete
    final model, no token is available, or the Hub refuses.
    """
    RunConfig.from_dict({**cfg.to_json_dict(), "hub": {"repo_id": repo_id, "private": private}},
                        source="the repository to push to")  # ConfigError when repo_id is not ORG/NAME
    listed = check_pushable(status, store, run_key)
    if api is None:
        token = hub_token()
        if token is None:
            raise LaunchError(f"pushing run {status.run_id} to {repo_id} needs a Hugging Face token with write "
                              "access: run `hf auth login` or export HF_TOKEN")
        api = _hf().HfApi(token=token)
    with tempfile.TemporaryDirectory(prefix="diloco-push-") as tmp:
        folder = Path(tmp)
        download_final(store, folder, listed)
        has_plot = False
        try:
            plot_losses(metrics, folder / "loss.png", title=cfg.run_id)
            has_plot = True
        except (ValueError, ImportError):
            pass  # no metrics (or no matplotlib): the card says what it can without the plot
        card = model_card(repo_id=repo_id, cfg=cfg, status=status, tokens=tokens_trained(metrics), has_plot=has_plot,
                          rl=rl_rounds(metrics))
        (folder / "README.md").write_text(card, encoding="utf-8")
        try:
            repo = api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
            api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=str(folder),
                              commit_message=f"diloco-serverless run {cfg.run_id}: final model")
        except Exception as e:
            raise LaunchError(f"pushing run {cfg.run_id} to {repo_id} failed: {one_line(str(e)) or type(e).__name__}; "
                              f"the run itself is fine, retry with: diloco push {store.url} {repo_id}") from e
    url = getattr(repo, "url", None)
    return str(url) if isinstance(url, str) and url else f"{HUB_URL}/{repo_id}"
