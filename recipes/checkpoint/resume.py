"""Which checkpoint a run starts from, decided before the model is built.

* ``train.resume=auto`` takes the checkpoint ``latest`` names; when the marker is missing or
  dangling, or that checkpoint fails verification (recipes.checkpoint.manifest) or loading, the
  newest complete one before it, saying which one and why. Nothing usable in a non-empty directory
  is an error, never a silent restart.
* ``train.resume=<dir>`` must verify and load; a failure names the file and offers the previous
  complete checkpoint of that directory.
* A run that saves and does not resume from a checkpoint of its own save directory
  (``resume=none``, or a checkpoint elsewhere) refuses a save directory that already holds
  checkpoints, unless ``train.overwrite=true``; even then no planned save may land on another
  run's checkpoint (recipes.checkpoint.lineage): such a run is refused before it trains.
* The saved config must agree with the current one in every shape-relevant key.
* A checkpoint already at or past ``train.steps`` leaves nothing to train: the run ends as
  completed (exit 0, as megatron's loop does for ``iteration >= train_iters``), saves and trims
  nothing, and says which step the checkpoint is at and that ``train.steps`` must be raised to train
  further (:func:`nothing_to_train`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from recipes.checkpoint import store as ckpt
from recipes.checkpoint.lineage import check_planned_saves, planned_steps
from recipes.checkpoint.integrity import latest_name, predates_manifests, verify
from recipes.checkpoint.manifest import CheckpointError, incompatibilities, read_manifest
from recipes.train.nonfinite import check_weights_finite
from recipes.checkpoint.resume_schedule import schedule_notes
from recipes.config.schema import Config
from recipes.config.typed import plain


@dataclass
class ResumePlan:
    """Where checkpoints go and what a run starts from."""

    root: Path
    path: Optional[Path]
    owner: ckpt.Owner
    explicit: bool = False
    fallbacks: list[Path] = field(default_factory=list)  # auto: older ones, newest first
    messages: list[str] = field(default_factory=list)
    start_step: int = 0  # the step ``path``'s manifest records (0 without one)


def checkpoint_root(cfg: DictConfig, run_dir: Path) -> Path:
    """``train.save`` or ``<run dir>/checkpoints``. In a Hydra multirun a ``train.save`` that is not
    per job (no interpolation, not inside the job's dir) gets the job's sub-directory appended, so
    that jobs never share (and prune or resume) each other's checkpoints. Takes the composed
    DictConfig: whether ``train.save`` was an interpolation is gone once it is converted to the
    schema's ``Config`` (:func:`recipes.config.typed.to_config` resolves it)."""
    save = cfg.train.save
    if not save:
        return run_dir / "checkpoints"
    root = Path(save)
    raw = OmegaConf.to_container(cfg.train, resolve=False)["save"]
    per_job = "${" in str(raw) or Path(run_dir).resolve() in root.resolve().parents
    subdir = _multirun_job_subdir(run_dir)
    return root if per_job or subdir is None else root / subdir


def _multirun_job_subdir(run_dir: Path) -> Optional[str]:
    """The job's directory relative to the sweep directory, in a multirun (else ``None``)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    hc = HydraConfig.get()
    try:
        return str(Path(run_dir).resolve().relative_to(Path(str(hc.sweep.dir)).resolve()))
    except ValueError:
        return f"job{hc.job.num}"


def _previous(path: Path) -> Optional[Path]:
    older = [p for p in ckpt.complete_checkpoints(path.parent) if p != path]
    return older[0] if older else None


def _check_config(path: Path, manifest: Optional[dict[str, Any]], current: dict[str, Any],
                  *, resume: bool, messages: list[str]) -> None:
    """Raise naming every shape-relevant key that differs; note the others and the LR schedule."""
    if manifest is None:
        messages.append(f"{path} has no manifest (written before manifests): neither verified "
                        "nor compared with the current config")
        return
    errors, notes = incompatibilities(manifest["config"], current, resume=resume)
    if errors:
        raise CheckpointError(
            f"{path} was saved with another model: " + "; ".join(errors) + ". Set these keys back "
            "to the checkpoint's values, or start a fresh run (another run id, or train.resume=none)")
    messages += [f"config differs from {path.name} (current value used): {n}" for n in notes]
    saved_steps = (manifest["config"].get("train") or {}).get("steps")
    now_steps = (current.get("train") or {}).get("steps")
    if resume:
        messages += schedule_notes(manifest["config"], current)
    more_to_train = now_steps is None or int(manifest.get("step", 0)) < now_steps
    if resume and saved_steps is not None and saved_steps != now_steps and more_to_train:
        messages.append(f"train.steps changed {saved_steps} -> {now_steps}: the LR schedule is "
                        f"re-planned (warmup and decay over {now_steps} steps) from the saved step")


def _auto(root: Path, messages: list[str]) -> tuple[Optional[Path], list[Path]]:
    """The checkpoint ``resume=auto`` takes and the older ones to fall back to."""
    latest = ckpt.latest_checkpoint(root)
    complete = ckpt.complete_checkpoints(root)
    if latest is None and complete:
        name = latest_name(root)
        why = (f"`latest` names {name!r}, which does not exist as a checkpoint directory in {root}"
               if name is not None else "there is no `latest` marker")
        messages.append(f"{why}: taking the newest complete checkpoint {complete[0].name}")
    order = ([latest] if latest else []) + [c for c in complete if c != latest]
    for i, candidate in enumerate(order):
        try:
            verify(candidate)
            return candidate, order[i + 1:]
        except CheckpointError as err:
            messages.append(f"skipping damaged checkpoint: {err}")
    dirs = ckpt.checkpoint_dirs(root)
    if dirs:
        raise CheckpointError(
            f"train.resume=auto: no usable checkpoint in {root} ({', '.join(d.name for d in dirs)}; "
            + " ".join(messages) + "). Fix or remove them, or start over with another run id or "
            "train.resume=none train.overwrite=true")
    return None, []


def plan_resume(cfg: Config, root: Path) -> ResumePlan:
    """Decide (on every rank, collectively: verification hashes in parallel) what to resume."""
    t = cfg.train
    current = plain(cfg)
    messages: list[str] = []
    explicit = t.resume not in ("auto", "none")
    fallbacks: list[Path] = []
    if t.resume == "none":
        path = None
    elif t.resume == "auto":
        path, fallbacks = _auto(root, messages)
    else:
        path = Path(t.resume)
        if not path.is_dir():
            raise CheckpointError(f"train.resume={t.resume!r}: no such checkpoint directory; "
                                  "allowed: auto, none or an existing checkpoint directory")
        try:
            verify(path)
        except CheckpointError as err:
            prev = _previous(path)
            offer = f"; the previous complete one is train.resume={prev}" if prev else ""
            raise CheckpointError(f"{err}{offer}") from err
    own = path is not None and path.resolve().parent == root.resolve()
    existing = ckpt.checkpoint_dirs(root)
    saves = bool(t.save_interval or t.save_final)
    if existing and not own and saves and not t.overwrite:
        raise CheckpointError(
            f"{root} already holds checkpoints ({', '.join(p.name for p in existing[-3:])}) of another "
            f"run and train.resume={t.resume}: a fresh run would mix its checkpoints with them. Use "
            "another run id (KPOOL_RUN_ID or train.save), train.resume=auto to continue them, or "
            "train.overwrite=true to write there anyway (theirs are kept, never pruned)")
    manifest = read_manifest(path) if path is not None else None
    if path is not None:
        _check_config(path, manifest, current, resume=True, messages=messages)
    lineage = (manifest or {}).get("lineage") or uuid.uuid4().hex
    start = int((manifest or {}).get("step", 0)) if path is not None else 0
    check_planned_saves(root, [ckpt.checkpoint_name(s) for s in planned_steps(t, start)], lineage)
    return ResumePlan(root, path, ckpt.Owner(lineage, current), explicit, fallbacks, messages, start)


def nothing_to_train(path: Optional[Path], step: int, steps: int) -> Optional[str]:
    """The console line for a resume from ``path`` at ``step`` when that is at or past
    ``steps`` (``train.steps``, the total the run ends at), else ``None``."""
    if path is None or step < steps:
        return None
    where = "is at" if step == steps else "is past"
    return (f"nothing to train: checkpoint {path} is at step {step} >= train.steps={steps} (the "
            f"run {where} its last step). To train further raise train.steps, the total step "
            f"count, e.g. train.steps={step + steps} for {steps} more steps")


def check_load(cfg: Config) -> list[str]:
    """Before the build: ``train.load`` verifies and matches the model; returns notes to print."""
    path = Path(cfg.train.load)
    if not path.is_dir():
        raise CheckpointError(f"train.load={cfg.train.load!r}: no such checkpoint directory")
    messages: list[str] = []
    _check_config(path, verify(path), plain(cfg), resume=False, messages=messages)
    return messages


def resume(plan: ResumePlan, model: Any, optimizer: Any, scheduler: Any,
           say: Callable[[str], None]) -> tuple[Path, ckpt.Progress]:
    """Load ``plan.path``; under ``resume=auto`` a checkpoint that fails to load is named and the
    previous complete one is used instead. Returns the checkpoint loaded and its progress."""
    order = [plan.path, *plan.fallbacks]
    for i, path in enumerate(order):
        try:
            if i > 0:
                notes: list[str] = []
                verify(path)
                _check_config(path, read_manifest(path), plan.owner.config, resume=True, messages=notes)
                for note in notes:
                    say(note)
            progress = ckpt.load_checkpoint(path, model, optimizer, scheduler)
            if predates_manifests(path):  # unverified bytes: at least the weights are finite
                check_weights_finite(ckpt.unwrap(model), progress.step, f"{path} predates manifests",
                                     what=f"the weights loaded from {path} (step {progress.step})")
            return path, progress
        except CheckpointError as err:
            failure: Exception = err
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - megatron / torch DCP read errors
            last_line = (str(err).strip().splitlines() or [""])[-1]  # DCP wraps a whole traceback
            failure = CheckpointError(f"{path} failed to load: {type(err).__name__}: {last_line}")
        if plan.explicit or i == len(order) - 1:
            prev = _previous(path)
            offer = f"; the previous complete checkpoint is train.resume={prev}" if prev else ""
            raise CheckpointError(f"{failure}{offer}") from failure
        say(f"checkpoint {path} is unusable ({failure}); resuming from {order[i + 1]} instead")
    raise CheckpointError("no checkpoint to resume from")  # only when plan.path is None
