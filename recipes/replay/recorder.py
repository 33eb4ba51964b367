"""Rollout records from our own model (``scripts/record_rollout.py``): its forward under the
run's precision on the rows ``data=rollout`` will pack, with hooks capturing every computing
indexer's top-k and megatron's ``RouterReplay`` recording every router's experts.

Per packed row: a first forward records the routers' experts; a second forward replays them (the
padding routed as ``data=rollout`` routes it) and gives the indexers' top-k and the logprobs
(``-`` the per-token loss, the function and numerics training computes), so replaying the records
in training repeats that forward exactly. Each sample's record holds its tokens, loss mask,
logprobs, ``indexer_topk.layer_<L>`` rebased to the sample start, ``routed_experts.layer_<L>``
and the model facts as metadata.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from kpool_layers.dsa.indexer import DSAIndexer
from recipes.checkpoint import store as ckpt
from recipes.launch import distributed
from recipes.config.megatron import to_transformer_config
from recipes.train.model import build_gpt_model
from recipes.replay.dataset import model_layers, pack, pack_row, packed_seq_params_from_starts
from recipes.replay.records import RolloutRecord, write_record
from recipes.replay.routing import routers
from recipes.config.schema import Config


def build_recording_model(cfg: Config) -> torch.nn.Module:
    """The model training builds for ``cfg`` (same seed, so the same initial weights; or
    ``train.load``'s weights), its indexers selecting (no top-k replay) and megatron's
    ``RouterReplay`` on every router. Needs
    torch.distributed initialised (one rank)."""
    distributed.init_model_parallel(cfg.parallelism, cfg.train.seed)
    tcfg = to_transformer_config(cfg)
    tcfg.dsa_topk_replay = False  # the indexers select: their top-k is what is recorded
    tcfg.moe_enable_routing_replay = bool(cfg.model.num_moe_experts)
    model: torch.nn.Module = build_gpt_model(cfg, tcfg)
    model = model.cuda() if torch.cuda.is_available() else model.to(
        torch.bfloat16 if tcfg.bf16 else torch.float32)
    if tcfg.bf16:
        model = Float16Module(tcfg, model)
    if cfg.train.load:
        ckpt.load_weights(cfg.train.load, model)
    return model


def _indexer_hooks(model: torch.nn.Module, captured: dict[int, torch.Tensor]) -> list:
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, DSAIndexer) and ".mtp." not in f".{name}":
            def hook(mod: DSAIndexer, args: tuple, output: object, layer: int = module.layer_number) -> None:
                captured[layer] = output.topk_indices.detach()
            handles.append(module.register_forward_hook(hook))
    return handles


def _forward(model: torch.nn.Module, row: dict[str, torch.Tensor]) -> torch.Tensor:
    """The per-token loss ``[1, s]`` of a packed row, as a training forward computes it."""
    with torch.enable_grad():
        return model(row["tokens"], row["position_ids"], None, labels=row["labels"],
                     packed_seq_params=packed_seq_params_from_starts(row["sample_starts"])).detach()


def _recorded_experts(model: torch.nn.Module, row: dict[str, torch.Tensor],
                      layer_routers: dict[int, torch.nn.Module]) -> dict[int, torch.Tensor]:
    """Every router's experts for the row (a forward under ``RECORD``), then made the routers'
    replay targets with the padding routed as ``data=rollout`` routes it (``pack_row``), so the
    recording forward after it is the training forward bit for bit (the experts' GEMM shapes, and
    so their roundings, depend on every token routed to them)."""
    if not layer_routers:
        return {}
    for router in layer_routers.values():
        router.router_replay.clear_indices()
        router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    _forward(model, row)
    padding = ~row["sample_tokens"].reshape(-1, 1)
    experts = {}
    for n, router in layer_routers.items():
        recorded = router.router_replay.get_recorded_indices()
        experts[n] = torch.where(padding, torch.arange(recorded.shape[1], device=recorded.device), recorded)
        router.router_replay.clear_indices()
        router.router_replay.set_target_indices(experts[n])
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    return {n: e.cpu() for n, e in experts.items()}


def record_rollouts(cfg: Config, model: torch.nn.Module, samples: list[torch.Tensor], out_dir: Path,
                    loss_masks: Optional[list[torch.Tensor]] = None) -> list[Path]:
    """Write ``record_<i>.safetensors`` for every sample (int64 ``[s_i]`` tokens; ``loss_masks``
    bool ``[s_i]`` or every token but the first) into ``out_dir``; returns the files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    layers = model_layers(cfg.model)
    records = [RolloutRecord(t.to(torch.int64), (m if m is not None else torch.arange(len(t)) > 0),
                             None, {}, {})
               for t, m in zip(samples, loss_masks or [None] * len(samples))]
    device = distributed.device()
    layer_routers = routers(model)
    captured: dict[int, torch.Tensor] = {}
    handles = _indexer_hooks(model, captured)
    files = []
    model.train()  # the numerics of a training forward (megatron sorts the top-k only with grad)
    try:
        for row_ids in pack(records, cfg.data.seq_length):
            row = {k: v.unsqueeze(0).to(device) for k, v in
                   pack_row([records[i] for i in row_ids], cfg.data.seq_length, layers).items()}
            experts = _recorded_experts(model, row, layer_routers)
            captured.clear()
            loss = _forward(model, row)
            logp = -loss[0].float().cpu()  # [s]: logprob of labels[p]
            topk = {n: idx[0].cpu() for n, idx in captured.items()}
            offset = 0
            for i in row_ids:
                rec, span = records[i], slice(offset, offset + records[i].length)
                logprobs = torch.zeros(rec.length)
                logprobs[1:] = logp[offset:offset + rec.length - 1]
                path = out_dir / f"record_{i:06d}.safetensors"
                write_record(path, rec.tokens, loss_mask=rec.loss_mask, logprobs=logprobs,
                             topk={n: torch.where(t[span] < 0, t[span], t[span] - offset)
                                   for n, t in topk.items()},
                             experts={n: e[span] for n, e in experts.items()}, facts=layers.facts)
                files.append(path)
                offset += rec.length
    finally:
        for handle in handles:
            handle.remove()
        for router in layer_routers.values():
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()
    return files
