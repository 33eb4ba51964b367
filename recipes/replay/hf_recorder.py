"""Rollout records from a transformers GLM-5.x model (``scripts/record_rollout.py --hf DIR``):
``glm_moe_dsa`` (GLM-5 / 5.1 / 5.2, ``GlmMoeDsaForCausalLM``), ``glm5_next`` (GLM-5.3,
``Glm5NextForConditionalGeneration``, text only) or ``glm5_next_text`` (GLM-5.3's text stack in the
causal-LM layout ``convert_checkpoint.py`` imports and exports: ``Glm5NextTextModel`` and the
checkpoint's ``lm_head.weight``, loaded as ``convert_checkpoint.py verify`` loads it), run on each
sample alone (batch 1, no padding,
no cache), with forward hooks on every computing indexer and every MoE router.

Index conventions, HF -> record (docs/replay.md). HF's decoder layer ``model.layers.N`` is the
record's layer ``L = N + 1``.

* ``glm_moe_dsa``: ``GlmMoeDsaIndexer`` returns int32 ``[1, S, min(index_topk, S)]`` token indices
  of ``torch.topk`` over causally masked scores. A query ``i`` with fewer than ``index_topk``
  visible keys also gets masked (``-inf``, future) keys, which the attention's causal mask then
  drops: those indices (``> i``) become ``-1``, and the row is ``-1``-padded to ``index_topk``.
* ``glm5_next``: ``Glm5NextTextIndexer`` selects KPool pools and returns their tokens (pool ``p``
  = tokens ``p * kpool .. p * kpool + kpool - 1`` from the sample's first token, our pools' layout),
  ``-1`` for empty slots, then with ``index_kpool_always_select_tail`` the incomplete pool's
  visible tokens: ``[1, S, index_topk (+ index_kpool - 1)]``, already the record's width and
  convention (indices after the query, which it never returns, would become ``-1`` as above).
* Layers without their own top-k have no ``indexer_topk``: IndexShare's ``"shared"`` layers (no
  indexer) and, by ``layer_types``, ``linear_attention`` (KDA) layers, which select no keys (their
  MoE routing is recorded like every MoE layer's).
* Routers (``*TopkRouter``): their third output, int64 ``[S, num_experts_per_tok]`` expert ids
  (grouped sigmoid top-k with the score-correction bias, unsorted: the record is a set per token).
* ``logprobs[i]`` = ``log_softmax(logits[i - 1])[tokens[i]]`` in float32, entry 0 is 0.

The records' metadata are the model facts of the HF config (:data:`HF_FACTS`), compared with our
model's when training (``records of another model``).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch
from torch import nn

from recipes.hf.io import HFReader
from recipes.hf.verify import FAMILIES, load_transformers, read_hf_config
from recipes.replay.records import write_record

HF_FACTS = {"num_layers": "num_hidden_layers", "vocab_size": "vocab_size",
            "dsa_indexer_topk": "index_topk", "dsa_indexer_kpool": "index_kpool",
            "dsa_indexer_kpool_always_select_tail": "index_kpool_always_select_tail",
            "num_moe_experts": "n_routed_experts", "moe_router_topk": "num_experts_per_tok"}
"""Record metadata key -> the HF text config's field (absent KPool fields: kpool 1, no tail)."""

_DEFAULTS = {"index_kpool": 1, "index_kpool_always_select_tail": False}
SUPPORTED = {"glm_moe_dsa": "GlmMoeDsaForCausalLM", "glm5_next": "Glm5NextForConditionalGeneration",
             "glm5_next_text": "Glm5NextTextModel"}
"""HF ``model_type`` -> the transformers class the recorder loads."""


class TextModelWithHead(nn.Module):
    """A base model returning final hidden states and the checkpoint's output head, as one module
    whose ``forward(input_ids=[1, S], use_cache=...)`` returns an object with ``.logits [1, S, V]``
    (the causal-LM interface the recorder reads); ``config`` is the base model's."""

    def __init__(self, model: nn.Module, logits: Any) -> None:
        super().__init__()
        self.model, self._logits, self.config = model, logits, model.config

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> Any:
        return SimpleNamespace(logits=self._logits(self.model, input_ids))


def load_hf_model(hf_dir: str | Path) -> nn.Module:
    """The transformers model of ``hf_dir`` in float32, eval mode; other model types are a
    ValueError naming ``model_type`` and the supported ones."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    if config.model_type not in SUPPORTED:
        raise ValueError(f"--hf {hf_dir}: model_type {config.model_type!r} is not supported; "
                         f"allowed: {', '.join(SUPPORTED)}")
    if config.model_type == "glm5_next_text":
        hf_config, reader = read_hf_config(hf_dir), HFReader(hf_dir)
        fam = FAMILIES[config.model_type]
        model = load_transformers(hf_dir, hf_config, fam, reader, hf_config["num_hidden_layers"])
        return TextModelWithHead(model, lambda m, ids: fam.logits(m, ids, reader, hf_config)).eval()
    cls = getattr(transformers, SUPPORTED[config.model_type])
    return cls.from_pretrained(hf_dir, dtype=torch.float32).eval()


def text_config(model: nn.Module) -> Any:
    """The decoder's config (``text_config`` of glm5_next)."""
    return model.config.get_text_config()


def facts(model: nn.Module) -> dict[str, str]:
    """The record metadata (:data:`HF_FACTS`) of ``model``, as our model's facts are written."""
    cfg = text_config(model)
    return {ours: str(getattr(cfg, theirs, _DEFAULTS.get(theirs))) for ours, theirs in HF_FACTS.items()}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The text decoder's layers (``model.layers`` / ``model.language_model.layers``)."""
    for name, module in model.named_modules():
        if (name.endswith("layers") and isinstance(module, nn.ModuleList) and len(module)
                and hasattr(module[0], "self_attn")):
            return module
    raise ValueError(f"{type(model).__name__}: no decoder layers with self_attn found")


def topk_width(model: nn.Module) -> int:
    """The record's ``indexer_topk`` width: ``index_topk (+ index_kpool - 1)``."""
    cfg = text_config(model)
    tail = getattr(cfg, "index_kpool_always_select_tail", False)
    return cfg.index_topk + (getattr(cfg, "index_kpool", 1) - 1 if tail else 0)


def to_record_topk(hf_indices: torch.Tensor, width: int) -> torch.Tensor:
    """HF indexer output ``[1, S, w]`` (w <= ``width``) -> int64 ``[S, width]``: indices after
    their query (or negative) are ``-1``, the row ``-1``-padded to ``width``."""
    idx = hf_indices[0].long()
    s, w = idx.shape
    if w > width:
        raise ValueError(f"HF indexer returned {w} indices per query, the record holds {width}")
    query = torch.arange(s, device=idx.device).unsqueeze(1)
    idx = torch.where((idx < 0) | (idx > query), -1, idx)
    return torch.cat([idx, idx.new_full((s, width - w), -1)], dim=1)


class HFCapture:
    """Forward hooks on ``model``'s computing indexers and MoE routers; after a batch-1 forward
    :attr:`topk` ``{L: HF output}`` and :attr:`experts` ``{L: [S, k]}`` hold what it selected."""

    def __init__(self, model: nn.Module) -> None:
        self.topk: dict[int, torch.Tensor] = {}
        self.experts: dict[int, torch.Tensor] = {}
        self._handles = []
        types = getattr(text_config(model), "layer_types", None)
        for n, layer in enumerate(decoder_layers(model)):
            kda = types is not None and types[n] == "linear_attention"  # selects no keys
            indexer = None if kda else getattr(layer.self_attn, "indexer", None)
            if indexer is not None:  # None on IndexShare's shared layers
                self._handles.append(indexer.register_forward_hook(self._store(self.topk, n + 1, None)))
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and type(gate).__name__.endswith("TopkRouter"):
                self._handles.append(gate.register_forward_hook(self._store(self.experts, n + 1, 2)))

    @staticmethod
    def _store(into: dict[int, torch.Tensor], layer: int, item: Optional[int]) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            into[layer] = (output if item is None else output[item]).detach()
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def record_hf_rollouts(model: nn.Module, samples: list[torch.Tensor], out_dir: Path,
                       loss_masks: Optional[list[torch.Tensor]] = None) -> list[Path]:
    """Write ``record_<i>.safetensors`` of every sample (int64 ``[s_i]``; ``loss_masks`` bool
    ``[s_i]`` or every token but the first) from ``model``'s forward (module docstring)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    width, metadata = topk_width(model), facts(model)
    capture = HFCapture(model)
    files = []
    try:
        for i, tokens in enumerate(samples):
            capture.topk.clear()
            capture.experts.clear()
            tokens = tokens.to(torch.int64)
            with torch.no_grad():
                logits = model(input_ids=tokens.unsqueeze(0), use_cache=False).logits[0].float()
            logprobs = torch.zeros(len(tokens))
            logprobs[1:] = logits[:-1].log_softmax(-1).gather(1, tokens[1:, None]).squeeze(1)
            mask = loss_masks[i] if loss_masks is not None else torch.arange(len(tokens)) > 0
            path = out_dir / f"record_{i:06d}.safetensors"
            write_record(path, tokens, loss_mask=mask, logprobs=logprobs,
                         topk={n: to_record_topk(t, width) for n, t in capture.topk.items()},
                         experts={n: e.reshape(len(tokens), -1) for n, e in capture.experts.items()},
                         facts=metadata)
            files.append(path)
    finally:
        capture.remove()
    return files
