"""The training loop: megatron-core's schedules, DDP, distributed optimizer, LR scheduler and
dist checkpoints, driven by a composed config.

``run(composed, run_dir)`` is what ``train.py`` calls on every rank. It validates the composed
DictConfig before anything expensive and converts it once into the schema's
:class:`~recipes.config.schema.Config` (:mod:`recipes.config.typed`), which everything after takes; then
it starts the process groups, builds the model for this pipeline stage, resumes if asked, trains
``train.steps`` optimizer steps and writes ``metrics.jsonl`` / ``result.json`` / checkpoints into
``run_dir`` (rank 0 writes the files; every rank takes part in checkpoints).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.datasets.utils import Split
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tokenizers import MegatronTokenizerBase
from megatron.core.transformer.module import Float16Module
from omegaconf import DictConfig

from kpool_layers.config import GLMTransformerConfig
from kpool_layers.hyper_connections import pipeline
from kpool_layers.compat.device_copy import to_device
from recipes.checkpoint import store as ckpt
from recipes.train import data as data_lib
from recipes.launch import distributed
from recipes.checkpoint import resume as resume_lib
from recipes.launch import run_owner
from recipes.launch.console import duration, say
from recipes.config.short_runs import fit_to_run_length
from recipes.train.cuda_graph import ForwardBackward, capture_stream
from recipes.train.data_checks import check_indexed_data
from recipes.train.evaluate import KEY as VAL_LOSS, Validator
from recipes.observe.drift import DriftMonitor
from recipes.plan.dry_run import check_all, dry_run, flop_model
from recipes.observe.indexer_loss import KEY as INDEXER_LOSS, IndexerLossMonitor
from recipes.config.megatron import to_transformer_config
from recipes.plan.peak_flops import PeakRates
from recipes.observe.metrics import (FlopModel, MetricsLogger, peak_memory_gib,
                             reset_peak_memory)
from recipes.train.model import build_gpt_model
from recipes.train.nonfinite import NonFiniteGuard
from recipes.train.optimizer import build_optimizer
from recipes.observe.precision_map import kernel_rows, precision_map, report_precision
from recipes.launch.preemption import Preempted, PreemptionGuard, Requeued
from recipes.plan.preflight import preflight
from recipes.launch.rank_agreement import check_ranks_agree
from recipes.launch.step_watchdog import StepWatchdog
from recipes.replay.dataset import RolloutDataset
from recipes.replay.step import RolloutStep, rollout_step
from recipes.launch.result import RunResult
from recipes.config.schema import Config, CudaGraphImpl, DataKind
from recipes.config.rules import validate
from recipes.config.typed import plain, to_config


@dataclass
class Trainer:
    """Everything one rank holds while training."""

    model: DistributedDataParallel
    optimizer: Any
    scheduler: OptimizerParamScheduler
    tcfg: GLMTransformerConfig
    num_microbatches: int
    precision_map: list[dict[str, Any]]


def _record(run_dir: Path, result: RunResult) -> None:
    """``result.json`` from rank 0 (:class:`recipes.launch.result.RunResult`)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        result.write(run_dir)


def run(composed: DictConfig, run_dir: Path, overrides: Optional[list[str]] = None,
        wandb_group: Optional[str] = None) -> float:
    """Train according to the ``composed`` config; returns the last step's loss (NaN for a dry
    run). ``wandb_group``: the sweep's id when this run is a job of a sweep. Rank 0 of a
    training run owns ``run_dir`` (:mod:`recipes.launch.run_owner`) from before anything in it is read
    until the end."""
    topo = distributed.launcher_topology()
    owner = run_owner.acquire(run_dir) if topo.rank == 0 and not composed.train.dry_run else None
    if owner is not None and owner.took_over:
        print(f"run directory {run_dir}: its previous owner ({owner.took_over}) ended without "
              "releasing it; this process takes it over", flush=True)
    try:
        return _run_owned(composed, run_dir, topo, overrides, wandb_group)
    finally:
        if owner is not None:
            owner.release()


def _run_owned(composed: DictConfig, run_dir: Path, topo: distributed.Topology,
               overrides: Optional[list[str]], wandb_group: Optional[str]) -> float:
    for note in fit_to_run_length(composed, overrides or []):
        if topo.rank == 0:
            print(note, flush=True)
    try:
        cfg, ckpt_root = _checked(composed, run_dir, topo.world_size)
        tokenizer = data_lib.build_tokenizer(cfg.data, cfg.model.vocab_size)  # fails here, not in the model
        check_indexed_data(cfg.data, cfg.model.vocab_size, validation=cfg.train.eval_interval > 0)
        if not cfg.train.dry_run:
            preflight(cfg, ckpt_root)
    except ValueError as err:
        if topo.rank == 0:
            RunResult.failed(str(err), overrides or []).write(run_dir)
        raise
    distributed.init_process_group(topo, cfg.train.collective_timeout_s)
    try:
        check_ranks_agree(plain(cfg))  # before any collective that depends on the config
        if cfg.train.dry_run:
            dry_run(cfg)
            return math.nan
        final = _train(cfg, run_dir, ckpt_root, overrides or [], tokenizer, wandb_group)
    except (Requeued, Preempted):
        raise  # result.json already says "preempted"; the requeued job resumes
    except BaseException as err:
        _record(run_dir, RunResult.failed(err, overrides or []))
        raise
    finally:
        distributed.shutdown()
    return final


def _checked(composed: DictConfig, run_dir: Path, world_size: int) -> tuple[Config, Path]:
    """The validated config (a dry run: every broken rule at once, for the configured machine,
    nodes x gpus_per_node) converted to the schema's :class:`~recipes.config.schema.Config`, and the
    checkpoint root (from ``train.save`` as composed, before interpolation)."""
    if composed.train.dry_run:
        check_all(composed, composed.parallelism.nodes * composed.parallelism.gpus_per_node)
    else:
        validate(composed, world_size)
    return to_config(composed), resume_lib.checkpoint_root(composed, run_dir)


def _build(cfg: Config) -> Trainer:
    distributed.init_model_parallel(cfg.parallelism, cfg.train.seed,
                                    graph_safe_rng=cfg.train.cuda_graph_impl is not CudaGraphImpl.none)
    tcfg = to_transformer_config(cfg, ddp=True)
    model: torch.nn.Module = build_gpt_model(cfg, tcfg)
    if not torch.cuda.is_available():
        model = model.to(torch.float32 if not tcfg.bf16 else torch.bfloat16)
    else:
        model = model.cuda()
    if tcfg.bf16:
        model = Float16Module(tcfg, model)
    # the precision map (roles and numerics fixed at the build) and the DSA kernels (model.dsa_kernels)
    precision_rows = precision_map(model) + kernel_rows(model)
    par = cfg.parallelism
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=par.overlap_grad_reduce,
        use_distributed_optimizer=par.use_distributed_optimizer,
    )
    ddp = DistributedDataParallel(tcfg, ddp_config, model)
    t = cfg.train
    optimizer = build_optimizer(ddp, t, par, bf16=tcfg.bf16, params_dtype=tcfg.params_dtype)
    dp = ps.get_data_parallel_world_size()
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr,
        lr_warmup_steps=t.lr_warmup_steps * t.global_batch_size,
        lr_decay_steps=t.steps * t.global_batch_size,
        lr_decay_style=t.lr_decay_style.value,
        start_wd=t.weight_decay, end_wd=t.weight_decay,
        wd_incr_steps=t.steps * t.global_batch_size, wd_incr_style="constant",
    )
    tcfg.grad_scale_func = optimizer.scale_loss
    tcfg.finalize_model_grads_func = finalize_model_grads
    tcfg.no_sync_func = ddp.no_sync
    return Trainer(ddp, optimizer, scheduler, tcfg,
                   t.global_batch_size // (t.micro_batch_size * dp), precision_rows)


def packed_eod_id(cfg: Config, tokenizer: MegatronTokenizerBase) -> Optional[int]:
    """The EOD token id when micro batches are packed documents (``data.reset_attention_mask``):
    each micro batch (one row) then runs as THD with ``cu_seqlens`` split after every EOD, so no
    query attends or selects keys across documents. ``None`` for plain causal batches."""
    if not cfg.data.reset_attention_mask:
        return None
    return int(tokenizer.eod)


def _batches(cfg: Config, consumed: int, tokenizer: MegatronTokenizerBase,
             rollout_data: Optional[RolloutDataset] = None) -> data_lib.ResumableBatchIterator:
    d, t = cfg.data, cfg.train
    if rollout_data is not None:
        dataset = rollout_data
    else:
        dataset = data_lib.build_dataset(
            d, Split.train, tokenizer=tokenizer, seq_length=d.seq_length,
            num_samples=t.steps * t.global_batch_size, seed=t.seed,
        )
    return data_lib.ResumableBatchIterator(
        dataset, micro_batch_size=t.micro_batch_size,
        dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
        consumed_samples=consumed, num_workers=d.num_workers,
    )


def _loss(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Token-mean cross entropy: (sum of losses, token count, [sum, count] for reporting).

    Under context parallelism each rank holds part of the tokens: it returns ``CP *`` its loss
    sum over the token count of all CP ranks, so that DDP's average over the data-parallel x CP
    ranks is the row's token mean (megatron's schedules divide by the count they get)."""
    mask = loss_mask.reshape(-1).float()
    loss_sum = (output.float().reshape(-1) * mask).sum()
    tokens = mask.sum()
    report = {"lm loss": torch.stack([loss_sum.detach(), tokens])}  # a copy: this rank's count
    cp = ps.get_context_parallel_world_size()
    if cp > 1:
        dist.all_reduce(tokens, group=ps.get_context_parallel_group())
        loss_sum = loss_sum * cp
    return loss_sum, tokens.to(torch.int), report


def _validator(cfg: Config, tokenizer: MegatronTokenizerBase, num_microbatches: int) -> Optional[Validator]:
    """The validation loss of ``train.eval_interval`` (:mod:`recipes.train.evaluate`; None when
    0): its dataset built now on every rank, its batches read from the start at each evaluation."""
    d, t = cfg.data, cfg.train
    if not t.eval_interval:
        return None
    dataset = data_lib.build_dataset(
        d, Split.valid, tokenizer=tokenizer, seq_length=d.seq_length,
        num_samples=t.eval_iters * t.global_batch_size, seed=t.seed)

    def batches() -> data_lib.ResumableBatchIterator:
        return data_lib.ResumableBatchIterator(
            dataset, micro_batch_size=t.micro_batch_size, dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(), num_workers=d.num_workers)

    return Validator(cfg, num_microbatches, batches, _reduce_loss)


def forward_step(device: torch.device, eod_id: Optional[int], data_iterator: Iterator[dict],
                 model: torch.nn.Module, rollout: Optional[RolloutStep] = None
                 ) -> tuple[torch.Tensor, Callable]:
    """megatron's forward_step_func: one micro batch through the model (packed when ``eod_id``,
    or a rollout row with its replay when ``rollout``), this context-parallel rank's part of it
    (:func:`recipes.train.data.context_parallel_slice`; the packed documents' boundaries describe the
    whole row)."""
    batch = {k: to_device(v, device) for k, v in next(data_iterator).items()
             if k != "attention_mask"}
    if rollout is not None:
        packed = rollout.prepare(batch)
    else:
        packed = None if eod_id is None else data_lib.packed_seq_params_from_eod(batch["tokens"], eod_id)
    batch = data_lib.context_parallel_slice(batch)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   packed_seq_params=packed)
    if rollout is not None:
        return output, partial(rollout.loss, _loss, batch)
    return output, partial(_loss, batch["loss_mask"])


def _reduce_loss(reports: list[dict], device: torch.device) -> float:
    """Global token-mean loss: summed on each last-stage TP-rank-0 replica, then over the world;
    on ``device``, read once (one host sync per step, none per micro batch)."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        for r in reports:
            totals += r["lm loss"].detach().double()
    dist.all_reduce(totals)
    return (totals[0] / totals[1].clamp(min=1)).item()


def _train(cfg: Config, run_dir: Path, ckpt_root: Path, overrides: list[str],
           tokenizer: MegatronTokenizerBase, wandb_group: Optional[str]) -> float:
    with capture_stream(cfg.train):  # a graphed run builds and steps on the capture stream
        return _train_steps(cfg, run_dir, ckpt_root, overrides, tokenizer, wandb_group)


def _train_steps(cfg: Config, run_dir: Path, ckpt_root: Path, overrides: list[str],
                 tokenizer: MegatronTokenizerBase, wandb_group: Optional[str]) -> float:
    t = cfg.train
    reset_peak_memory(distributed.device())  # a sweep's earlier jobs ran in this process
    plan = resume_lib.plan_resume(cfg, ckpt_root)  # before the build
    for message in plan.messages + (resume_lib.check_load(cfg) if t.load and plan.path is None else []):
        _print0(message)
    if done := resume_lib.nothing_to_train(plan.path, plan.start_step, t.steps):
        return _already_done(run_dir, overrides, done, plan.start_step)  # before the build
    rollout_data = None  # data=rollout: every record read and validated before the build
    if cfg.data.kind is DataKind.rollout:
        rollout_data = RolloutDataset(cfg, min_rows=t.steps * t.global_batch_size)
    trainer = _build(cfg)
    progress = ckpt.Progress()
    if plan.path is not None:
        loaded, progress = resume_lib.resume(plan, trainer.model, trainer.optimizer, trainer.scheduler, _print0)
        _print0(f"resumed from {loaded} at step {progress.step}")  # MetricsLogger trims later steps
        if done := resume_lib.nothing_to_train(loaded, progress.step, t.steps):  # no manifest
            return _already_done(run_dir, overrides, done, progress.step)
    elif t.load:
        ckpt.load_weights(t.load, trainer.model)
        _print0(f"loaded weights from {t.load}")
    device = distributed.device()
    batches = _batches(cfg, progress.consumed_samples, tokenizer, rollout_data)
    eod_id = packed_eod_id(cfg, tokenizer)
    rank0 = dist.get_rank() == 0
    logger = MetricsLogger(run_dir, cfg.logging, plain(cfg), enabled=rank0,
                           resume_step=progress.step, group=wandb_group)
    # precision: the map (console, run dir, wandb config) and the top-k drift monitor.
    report_precision(trainer.precision_map, trainer.tcfg.precision, run_dir, logger,
                     full=cfg.logging.print_precision_map)
    drift = DriftMonitor(cfg.precision.drift, trainer.model, cfg.model.num_layers)
    indexer_loss = IndexerLossMonitor(cfg.model, cfg.precision.drift.interval)
    rollout = rollout_step(cfg, trainer.model)
    validator = _validator(cfg, tokenizer, trainer.num_microbatches)
    guard = PreemptionGuard()
    nonfinite = NonFiniteGuard(t.nonfinite_skip)
    watchdog = StepWatchdog(t.collective_timeout_s, dist.get_rank())
    fwd_bwd = ForwardBackward(t)
    tokens_per_step = t.global_batch_size * cfg.data.seq_length
    flops = flop_model(cfg)
    peaks = PeakRates.for_device(torch.cuda.get_device_name(device) if device.type == "cuda" else "",
                                 t.peak_tflops)
    loss = math.nan
    status, requeued = "completed", False
    train_start, first_step = time.perf_counter(), progress.step
    try:
        while progress.step < t.steps:
            watchdog.begin(progress.step + 1)
            start = time.perf_counter()
            trainer.model.zero_grad_buffer()
            trainer.optimizer.zero_grad()
            measure_drift = drift.due(progress.step + 1)
            if measure_drift:
                drift.arm()
            if rollout is not None:
                rollout.begin(measure_drift)
            reports = fwd_bwd(  # the drift hooks run Python in the forward: no graph replay
                eager=measure_drift or rollout is not None,
                forward_step_func=partial(forward_step, device, eod_id, rollout=rollout),
                data_iterator=batches,
                model=[trainer.model], num_microbatches=trainer.num_microbatches,
                seq_length=cfg.data.seq_length, micro_batch_size=t.micro_batch_size,
                forward_only=False, **pipeline.schedule_kwargs([trainer.model]),  # mHC streams' p2p shape
            )
            if fwd_bwd.just_captured:
                _print0(f"step {progress.step + 1}: forward-backward captured as one CUDA graph; "
                        f"later steps replay it")
            drift_metrics = drift.measure() if measure_drift else None  # same weights as the forward
            loss = _reduce_loss(reports, device)
            grad_norm: Optional[float | torch.Tensor] = math.nan  # logged as such when the update is skipped
            if nonfinite.apply_step(progress.step + 1, loss, trainer.model,
                                    f"the last checkpoint in {ckpt_root} holds the last saved state"):
                _, grad_norm, _ = trainer.optimizer.step()
                trainer.scheduler.step(increment=t.global_batch_size)
            else:
                _print0(f"step {progress.step + 1}: non-finite loss or gradients, update skipped "
                        f"({nonfinite.skipped}/{t.nonfinite_skip} of train.nonfinite_skip)")
            progress.step += 1
            progress.consumed_samples += t.global_batch_size
            step_time = time.perf_counter() - start
            due_eval = validator is not None and validator.due(progress.step)
            logged = progress.step % t.log_interval == 0 or progress.step == t.steps or due_eval
            extra = indexer_loss.step_scalars(trainer.model, progress.step, logged)
            if due_eval:  # after the update: the weights step progress.step left
                extra.update(validator.scalars(progress.step, trainer.model,
                                               partial(forward_step, device, eod_id), device))
            if rollout is not None:
                extra.update(rollout.end(reports, device))
            if logged:
                elapsed = time.perf_counter() - train_start
                eta = elapsed / (progress.step - first_step) * (t.steps - progress.step)
                _log_step(logger, progress.step, loss, grad_norm, trainer, step_time,
                          cfg.data.seq_length, tokens_per_step, flops, peaks, device, t.steps, extra,
                          f" | {duration(elapsed)} elapsed, ETA {duration(eta)}")
            elif extra:
                logger.log(progress.step, extra)
            if drift_metrics is not None:
                drift.log(logger, progress.step, drift_metrics)
            stop = guard.should_stop()
            if stop or (t.save_interval and progress.step % t.save_interval == 0):
                path = ckpt.save_checkpoint(ckpt_root, trainer.model, trainer.optimizer,
                                            trainer.scheduler, progress, t.keep_checkpoints, plan.owner)
                _print0(f"saved checkpoint {path}")
            watchdog.end()
            if stop:
                status = "preempted"
                _print0(f"{guard.signal_name} received: checkpoint saved at step {progress.step}")
                requeued = guard.requeue()
                break
        saved_last = t.save_interval and progress.step % t.save_interval == 0
        if status == "completed" and t.save_final and not saved_last:
            path = ckpt.save_checkpoint(ckpt_root, trainer.model, trainer.optimizer,
                                        trainer.scheduler, progress, t.keep_checkpoints, plan.owner)
            _print0(f"saved checkpoint {path}")
    except Exception as err:
        watchdog.check(err)  # a step that ran past train.collective_timeout_s: CollectiveTimeout
        raise
    finally:
        watchdog.close()
        fwd_bwd.close()
        guard.close()
        logger.close()
    _record(run_dir, RunResult(status, None, overrides, loss, progress.step))
    _print0(f"{status}: {progress.step} steps, {progress.consumed_samples * cfg.data.seq_length:,} "
            f"tokens, {duration(time.perf_counter() - train_start)}, final loss {loss:.4f}, "
            f"run dir {run_dir}")
    if requeued:
        raise Requeued()
    if status == "preempted":
        raise Preempted(f"preempted by {guard.signal_name or 'another rank'} at step {progress.step}, "
                        f"checkpoint {path} saved; resume with train.resume={path} (or rerun into the "
                        f"same run directory {run_dir} with train.resume=auto)")
    return loss


def _already_done(run_dir: Path, overrides: list[str], message: str, step: int) -> float:
    """End a run whose checkpoint is at or past ``train.steps``: completed, nothing trained,
    saved or trimmed; returns NaN (no step ran)."""
    _print0(message)
    _record(run_dir, RunResult("completed", None, overrides, None, step))
    _print0(f"completed: 0 steps trained (checkpoint at step {step}), run dir {run_dir}")
    return math.nan


def _log_step(logger: MetricsLogger, step: int, loss: float, grad_norm: Optional[float | torch.Tensor],
              trainer: Trainer, step_time: float, seq_length: int, tokens_per_step: int,
              flops: FlopModel, peaks: PeakRates, device: torch.device, total_steps: int,
              extra: dict[str, float], timing: str) -> None:
    lr = trainer.optimizer.param_groups[0]["lr"]
    tokens_per_s = tokens_per_step / step_time
    scalars = {"loss": loss, "grad_norm": 0.0 if grad_norm is None else float(grad_norm), "lr": lr,
               "tokens_per_s": tokens_per_s, "step_time_s": step_time,
               "peak_mem_gib": peak_memory_gib(device), **extra}
    line = (f"step {step:>5}/{total_steps} | loss {loss:.4f} | grad_norm {scalars['grad_norm']:.3f}"
            f" | lr {lr:.3e} | {tokens_per_s:,.0f} tok/s")
    if device.type == "cuda":
        tflops = flops.per_token(seq_length) * tokens_per_s / dist.get_world_size() / 1e12
        scalars["tflops_per_gpu"] = tflops
        mfu, text = peaks.report(tflops)
        scalars.update(mfu)
        line += f" | {tflops:.0f} TFLOP/s/GPU{text}"
    line += f" | peak {scalars['peak_mem_gib']:.2f} GiB"
    if VAL_LOSS in extra:
        line += f" | val_loss {extra[VAL_LOSS]:.4f}"
    if INDEXER_LOSS in extra:
        line += f" | indexer_loss {extra[INDEXER_LOSS]:.3e}"
    line += timing
    logger.log(step, scalars, console=line)


def _print0(msg: str) -> None:
    """A console line: printed by rank 0, kept in every rank's log file."""
    say(msg, show=not dist.is_initialized() or dist.get_rank() == 0)
