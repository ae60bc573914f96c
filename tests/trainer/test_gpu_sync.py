"""Host-device synchronisations of the inner step on a GPU: at most one per inner step with the default
loss channels (the round's first step adds the batch validation, once per round).

On CUDA, ``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronising operation (``item``,
``bool`` of a device tensor, ``nonzero``, a blocking host<->device copy, ``torch.cuda.synchronize``, ...)
warn "called a synchronizing CUDA operation". :class:`CudaSyncs` catches each of those warnings while
it is raised and, like ``support.host_reads.HostReads``, charges it to the nearest caller outside torch:
this package's code (``sites``, as ``"loss/compose.py:310"``) or anything else (``others``: transformers'
mask code makes its own in every forward pass, as a hand-written loop's forward does; reported, not
budgeted). Unlike ``HostReads`` it also sees what only a GPU syncs on: blocking copies to the device
(``torch.tensor(x, device="cuda")``), pageable ``.to("cuda")``, syncs in the data thread.

``test_inner_steps_sync_at_most_once_per_step_on_cuda`` runs the first inner steps of a round of the
tiny model on CUDA (all three compose_loss channels live, as in test_inner_step.py; H large enough that
no exchange happens) and skips without CUDA. On every machine, the CPU tests check the counter
(synthetic sync warnings from frames in this package, in torch and in transformers) and run the same
steps and the same budget check on the CPU with ``HostReads`` (the reads that are syncs on a GPU).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
import transformers

import diloco_serverless
from diloco_serverless.trainer.loop import ReplicaTrainer, _Segment
from support.diloco_harness import create_tiny_run, write_jsonl
from support.host_reads import HostReads

SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's TORCH_WARN under sync debug mode "warn"
_PACKAGE = os.path.dirname(os.path.abspath(diloco_serverless.__file__)) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_WARNINGS = os.path.abspath(warnings.__file__)
_STEPS = 5  # counted inner steps: the round's first (validation) and 4 later ones

NO_CUDA = (
    "needs a CUDA device: counts host-device syncs with torch.cuda.set_sync_debug_mode('warn'); "
    f"torch {torch.__version__} "
    + ("is a CPU-only build" if torch.version.cuda is None else f"(CUDA {torch.version.cuda}) finds no CUDA device")
)


def _site(frame: FrameType | None) -> tuple[bool, str]:
    """``(in this package, "file:line")`` of the nearest frame outside torch and the warnings module."""
    while frame is not None and (
        frame.f_code.co_filename.startswith(_TORCH) or os.path.abspath(frame.f_code.co_filename) == _WARNINGS
    ):
        frame = frame.f_back
    if frame is None:
        return False, "?"
    name = frame.f_code.co_filename
    if name.startswith(_PACKAGE):
        return True, f"{name[len(_PACKAGE):]}:{frame.f_lineno}"
    for marker in ("site-packages" + os.sep, "tests" + os.sep):
        if marker in name:
            name = name.rsplit(marker, 1)[1]
            break
    return False, f"{name}:{frame.f_lineno}"


class CudaSyncs:
    """``with CudaSyncs() as syncs: ...``: CUDA sync debug mode "warn" (only where CUDA is available;
    restored on exit) and each sync warning raised meanwhile, in any thread, recorded by its site
    (``sites``: this package's, ``others``: the rest). Other warnings are left alone. ``match``: the
    warning text counted (another one lets a CPU test count a warning that torch's C++ raises)."""

    def __init__(self, match: str = SYNC_WARNING) -> None:
        self.match = match
        self.sites: list[str] = []
        self.others: list[str] = []
        self._mode: int | None = None
        self._catch: Any = None
        self._show: Callable[..., Any] | None = None

    def __enter__(self) -> CudaSyncs:
        self._catch = warnings.catch_warnings()  # restores filters and showwarning on exit
        self._catch.__enter__()
        self._show = warnings.showwarning
        warnings.simplefilter("always", UserWarning)  # every sync, not once per call site
        warnings.showwarning = self._record  # runs while the warning is raised: the caller's stack is live
        if torch.cuda.is_available():
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mode is not None:
            torch.cuda.set_sync_debug_mode(self._mode)
        self._catch.__exit__(*exc)

    def _record(self, message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                line: Any = None) -> None:
        if self.match not in str(message):
            assert self._show is not None
            self._show(message, category, filename, lineno, file, line)
            return
        ours, site = _site(sys._getframe(1))  # skips this method's own frame
        (self.sites if ours else self.others).append(site)

    def __len__(self) -> int:
        return len(self.sites)


# ------------------------------------------------------------------ the harness (CPU and GPU alike)
def count_per_step(trainer: ReplicaTrainer, steps: int, counter: Callable[[], Any]) -> list[Any]:
    """One uncounted warm-up step (CUDA context, kernels, the optimizer state), then ``steps`` inner steps of
    a new round segment, each inside a fresh ``counter()``; returns the counters."""
    counters = []
    with trainer.rep:  # DiLoCo's optimizer hooks, as in ReplicaTrainer.run
        trainer._inner_step(_Segment())
        seg = _Segment()
        for _ in range(steps):
            with counter() as c:
                trainer._inner_step(seg)
            counters.append(c)
    assert not trainer.rep.at_boundary, "no exchange in the counted steps"
    return counters


def check_budget(per_step: list[list[str]]) -> None:
    """The round's first step: at most 2 (batch validation + the chosen-is-student check of the replay
    channel); every later step: at most 1 (the chosen-is-student check)."""
    counts = [len(sites) for sites in per_step]
    assert counts[0] <= 2, f"the round's first step synced {counts[0]} times: {per_step[0]}"
    over = {i: sites for i, sites in enumerate(per_step) if i > 0 and len(sites) > 1}
    assert not over, f"inner steps with more than one host sync in this package's code: {over} (all: {per_step})"


def _trainer(tmp: Path, device: str) -> ReplicaTrainer:
    """Rank 0 of a 1-replica run, default loss (all three channels live), batches of 4 x 64, H = 100."""
    data = write_jsonl(tmp / "data.jsonl")
    url = create_tiny_run(f"file://{tmp}/store", data, 1, rounds=1, sync_every=100,
                          **{"data.batch_size": 4, "data.seq_len": 64})
    trainer = ReplicaTrainer.from_run(url, 0, device=device)
    assert trainer.cfg.loss.alpha_sdpo > 0 and trainer.cfg.loss.beta_replay > 0, "the default channels"
    return trainer


@pytest.fixture
def cpu_trainer(tmp_path: Path) -> Iterator[ReplicaTrainer]:
    trainer = _trainer(tmp_path, "cpu")
    yield trainer
    trainer.data.close()
    trainer.manager.shutdown()


# ------------------------------------------------------------------ CPU: the counter and the harness
def test_sync_warnings_are_charged_to_the_nearest_caller_outside_torch() -> None:
    """Synthetic sync warnings raised from a 'torch' frame called by a package frame, by a
    transformers frame and by this test: the first is the package's, the others are not; other
    warnings pass through; the warning filters and showwarning are restored afterwards."""
    ns: dict[str, Any] = {"warnings": warnings, "MSG": SYNC_WARNING}
    fake = {  # code objects whose file names place them in torch, in this package, in transformers
        "op": (_TORCH + "_fake_sync_op.py", "def op():\n    warnings.warn(MSG, UserWarning)\n"),
        "ours": (_PACKAGE + "loss/_fake_sync_site.py", "def ours():\n    op()\n"),
        "theirs": (os.path.dirname(transformers.__file__) + "/masking_utils_fake.py", "def theirs():\n    op()\n"),
    }
    for filename, source in (fake[k] for k in ("op", "ours", "theirs")):
        exec(compile(source, filename, "exec"), ns)
    with warnings.catch_warnings(record=True) as passed:
        warnings.simplefilter("default")
        show_before, filters_before = warnings.showwarning, list(warnings.filters)
        with CudaSyncs() as syncs:
            ns["ours"]()
            ns["ours"]()
            ns["theirs"]()
            warnings.warn(SYNC_WARNING, UserWarning, stacklevel=1)  # from this test: not the package's
            warnings.warn("something else", UserWarning, stacklevel=1)
        assert warnings.showwarning is show_before and warnings.filters == filters_before
    assert syncs.sites == ["loss/_fake_sync_site.py:2", "loss/_fake_sync_site.py:2"], syncs.sites
    line = test_sync_warnings_are_charged_to_the_nearest_caller_outside_torch.__code__.co_firstlineno
    assert len(syncs.others) == 2 and syncs.others[0].endswith("masking_utils_fake.py:2"), syncs.others
    assert syncs.others[1].startswith("trainer/test_gpu_sync.py:") and int(syncs.others[1].rsplit(":")[1]) > line
    assert len(syncs) == 2
    assert [str(w.message) for w in passed] == ["something else"]


def test_warnings_from_torch_cpp_code_are_charged_while_the_stack_is_live() -> None:
    """The CUDA sync warning is a TORCH_WARN of torch's C++ code; one such warning that a CPU raises
    too (an ``out=`` tensor resized) reaches the counter while the calling package frame is live."""
    ns: dict[str, Any] = {"torch": torch}
    source = "def ours():\n    torch.add(torch.ones(2), torch.ones(2), out=torch.empty(3))\n"
    exec(compile(source, _PACKAGE + "loss/_fake_sync_site.py", "exec"), ns)
    with CudaSyncs(match="An output with one or more elements was resized") as resized:
        ns["ours"]()
        ns["ours"]()
    assert resized.sites == ["loss/_fake_sync_site.py:2"] * 2 and resized.others == []


def test_budget_check_counts_per_step() -> None:
    check_budget([["loss/compose.py:310", "loss/_batch.py:40"], ["loss/compose.py:310"], []])
    with pytest.raises(AssertionError, match="first step synced 3 times"):
        check_budget([["a:1", "b:2", "c:3"], []])
    with pytest.raises(AssertionError, match=r"more than one host sync.*\{2: \['a:1', 'b:2'\]\}"):
        check_budget([["a:1"], ["a:1"], ["a:1", "b:2"]])


def test_inner_steps_on_cpu_keep_the_sync_budget(cpu_trainer: ReplicaTrainer) -> None:
    """The GPU test's steps and budget on the CPU, counted with HostReads (each read is a sync on a
    GPU): exactly 2 on the round's first step, then 1 per step. CudaSyncs around a CPU step records
    nothing and leaves the sync debug mode alone."""
    per_step = [c.sites for c in count_per_step(cpu_trainer, _STEPS, HostReads)]
    check_budget(per_step)
    assert [len(s) for s in per_step] == [2] + [1] * (_STEPS - 1), per_step
    assert all(site.startswith("loss/") for sites in per_step for site in sites), per_step
    (syncs,) = count_per_step(cpu_trainer, 1, CudaSyncs)
    assert syncs.sites == [] and syncs.others == []


# ------------------------------------------------------------------ GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_inner_steps_sync_at_most_once_per_step_on_cuda(tmp_path: Path) -> None:
    """The tiny model on CUDA, default channels, prefetch on: the round's first step syncs at most
    twice in this package's code, every later step at most once (a blocking copy to the device, a
    ``.item()`` in the loss or the loop, a sync in the data thread would all count)."""
    torch.zeros(1, device="cuda").sum().item()  # CUDA initialised outside the counter
    with CudaSyncs() as probe:  # the counter sees real CUDA syncs (one from this test's own code)
        torch.ones(1, device="cuda").sum().item()
    assert probe.sites == [] and len(probe.others) == 1 and probe.others[0].startswith("trainer"), probe.others

    trainer = _trainer(tmp_path, "cuda")
    try:
        assert trainer.device.type == "cuda" and next(trainer.model.parameters()).is_cuda
        counters = count_per_step(trainer, _STEPS, CudaSyncs)
        torch.cuda.synchronize()
    finally:
        trainer.data.close()
        trainer.manager.shutdown()
    per_step = [c.sites for c in counters]
    others = [len(c.others) for c in counters]
    print(f"CUDA syncs per inner step: this package {[len(s) for s in per_step]} {per_step}; "
          f"other code (transformers' masks, ...) {others} {counters[-1].others}")
    check_budget(per_step)
