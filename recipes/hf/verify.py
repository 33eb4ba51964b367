"""Logit parity of one HF checkpoint between transformers and our model (``convert_checkpoint.py verify``).

:func:`verify` runs the same token batch through transformers' model of the checkpoint and through
our ``GPTModel`` (weights from a megatron checkpoint, or the HF tensors mapped in memory by the
import's :mod:`recipes.hf.mapping`), both on CPU in float32, and returns a :class:`Report`: max and
mean ``|Δlogit|``, top-1 agreement and the bound (:func:`default_bound`) that ``max |Δlogit|`` must
not exceed.

* Tokens: ``tokens // seq_len`` rows of ``seq_len`` ids drawn uniformly from the vocabulary by a
  ``torch.Generator`` seeded with ``seed``; positions ``0 .. seq_len - 1`` in every row. ``packed``
  hands the rows to our model as documents of one THD row (``cu_seqlens`` at the row boundaries),
  transformers still runs them as a batch: the logits must be those of each document alone.
* The transformers side is chosen by the HF config's ``model_type`` in :data:`FAMILIES`: the model
  class and how its logits are computed (``GlmMoeDsaForCausalLM`` returns them; ``glm5_next_text``'s
  ``Glm5NextTextModel`` returns the final hidden states, which are multiplied by the checkpoint's
  ``lm_head.weight``, or the embedding when tied). Its load must use every tensor of the
  checkpoint (MTP layers and the head the family reads itself excepted) and miss none.
* Logits are compared as ``[rows, seq_len, vocab]``.

Megatron's parallel state must be initialised at TP = PP = EP = 1 before :func:`verify` is called
(``scripts/convert_checkpoint.py`` does it).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from recipes.hf.config import model_config_from_hf
from recipes.hf.io import HFReader
from recipes.hf.mapping import build_mapping, check_hf_names, layer_index

FP32_UNIT_ROUNDOFF = 2.0**-24
STAGES_PER_LAYER = 14
"""Reductions a logit passes through per decoder layer: attention (input norm, q down, q norm, q up,
kv down, kv norm, kv up, q·k, softmax sum, p·v, output projection) and MLP (pre-MLP norm, fc1, fc2)."""
HEAD_STAGES = 2
"""The final norm and the output layer."""
IMPLEMENTATIONS = 2
"""Two fp32 implementations, each with its own rounding error: their difference is up to the sum."""
GROWTH = 8
"""Allowance for the network amplifying rounding errors (residual stream, normalisations, softmax):
the one factor not derived a priori, chosen with the measured margin on the CPU tests (docs/hf_interop.md)."""
DEFAULT_TOKENS = 128
DEFAULT_SEQ_LEN = 64
IGNORED_CONFIG_KEYS = ("name", "init_method_std", "dsa_indexer_rotate_activation")
"""Derived model keys a checkpoint may differ in from config.json and still be the same model:
its name, the initialisation scale (no effect on a forward), and the indexer's Hadamard rotation,
which is orthonormal where it acts (after pooling), so it changes scores only by rounding
(recipes/hf/config.py)."""


def _logits_from_output(model: Any, ids: torch.Tensor, reader: HFReader, config: dict[str, Any]) -> torch.Tensor:
    """A ``*ForCausalLM``: the logits it returns."""
    return model(input_ids=ids).logits


def _logits_from_hidden(model: Any, ids: torch.Tensor, reader: HFReader, config: dict[str, Any]) -> torch.Tensor:
    """A base model returning final hidden states: times the checkpoint's ``lm_head.weight``
    (``model.embed_tokens.weight`` when ``tie_word_embeddings``)."""
    hidden = model(input_ids=ids).last_hidden_state
    head = "model.embed_tokens.weight" if config.get("tie_word_embeddings", False) else "lm_head.weight"
    return hidden @ reader.get(head).float().T


@dataclass(frozen=True)
class HFFamily:
    """How transformers runs one ``model_type``: the model class, the logits of its output, and the
    checkpoint tensors its load leaves to the logits function or does not model (regexes)."""

    model_class: str
    logits: Callable[[Any, torch.Tensor, HFReader, dict[str, Any]], torch.Tensor]
    not_loaded: tuple[str, ...] = ()


FAMILIES: dict[str, HFFamily] = {
    "glm_moe_dsa": HFFamily("GlmMoeDsaForCausalLM", _logits_from_output),
    "glm5_next_text": HFFamily("Glm5NextTextModel", _logits_from_hidden, (r"^lm_head\.weight$",)),
}


@dataclass(frozen=True)
class Report:
    """The figures of one verification (``max_abs_diff`` etc. over every logit)."""

    rows: int
    seq_len: int
    packed: bool
    max_abs_diff: float
    mean_abs_diff: float
    max_at: tuple[int, int, int]
    top1_agree: int
    positions: int
    max_abs_logit: float
    bound: float
    bound_derivation: str
    over_bound: tuple[tuple[int, int], ...]
    max_abs_diff_elsewhere: float

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.bound

    def lines(self) -> list[str]:
        """What ``verify`` prints."""
        r, s, v = self.max_at
        lines = [f"max |Δlogit|   {self.max_abs_diff:.3e}  (row {r}, position {s}, token {v}; max |logit| "
                f"{self.max_abs_logit:.3e})",
                f"mean |Δlogit|  {self.mean_abs_diff:.3e}",
                f"top-1 agree    {self.top1_agree}/{self.positions} ({100 * self.top1_agree / self.positions:.2f}%)",
                f"bound          {self.bound:.3e}  {self.bound_derivation}",
                "PASS" if self.passed else f"FAIL: max |Δlogit| {self.max_abs_diff:.3e} > bound {self.bound:.3e}"]
        if not self.passed:
            shown = ", ".join(f"({r}, {s})" for r, s in self.over_bound[:8])
            lines.append(f"over the bound: {len(self.over_bound)} of {self.positions} positions (row, position): "
                         f"{shown}{' ...' if len(self.over_bound) > 8 else ''}; max |Δlogit| at the other positions "
                         f"{self.max_abs_diff_elsewhere:.3e}")
            if (2 * len(self.over_bound) < self.positions and self.max_abs_diff_elsewhere <= self.bound / 10
                    and self.max_abs_diff > 10 * self.bound):
                lines.append(TIE_HINT)
        return lines


TIE_HINT = ("a few positions far over the bound and the rest at a tenth of it or less is what a top-k tie broken differently "
            "looks like (the indexer's ReLU scores tie at exactly 0 where no head scores a key positive; "
            "the two implementations pick different tied keys): --seq-len <= index_topk makes the selection "
            "dense and checks the rest of the model")


def family(hf_config: dict[str, Any], hf_dir: str | os.PathLike) -> HFFamily:
    """The :class:`HFFamily` of ``hf_config``; ``ValueError`` naming its ``model_type`` otherwise."""
    kind = hf_config.get("model_type")
    if kind not in FAMILIES:
        raise ValueError(f"{Path(hf_dir) / 'config.json'}: model_type={kind!r} has no transformers reference "
                         f"for verify; allowed: {', '.join(FAMILIES)}")
    return FAMILIES[kind]


def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """``--hf``'s ``config.json``; errors name the directory or the file."""
    path = Path(hf_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"--hf {hf_dir}: no such HF checkpoint directory")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--hf {hf_dir}: no config.json (verify needs it to build transformers' model)")
    return json.loads((path / "config.json").read_text())


def check_same_model(model_cfg: Any, hf_config: dict[str, Any], ckpt: str | os.PathLike,
                     hf_dir: str | os.PathLike, skip_mtp: bool = False) -> None:
    """``ValueError`` naming every model key whose value in the checkpoint's config (``model_cfg``)
    differs from the one :func:`recipes.hf.config.model_config_from_hf` derives from ``hf_config``
    (without its MTP layers with ``skip_mtp``; keys in :data:`IGNORED_CONFIG_KEYS` excepted)."""
    derived = model_config_from_hf(hf_config, "hf", skip_mtp)
    diffs = []
    for key, want in derived.items():
        have = getattr(model_cfg, key)
        if key in IGNORED_CONFIG_KEYS or have == want:
            continue
        if isinstance(want, float) and have is not None and math.isclose(float(have), want, rel_tol=1e-12):
            continue
        diffs.append(f"{key}: checkpoint {have!r}, config.json {want!r}")
    if diffs:
        raise ValueError(f"--ckpt {ckpt} is another model than --hf {Path(hf_dir) / 'config.json'} "
                         f"({len(diffs)} keys): " + "; ".join(diffs))


def check_tokens(tokens: int, seq_len: int) -> int:
    """Rows of the batch; ``ValueError`` naming ``--tokens`` / ``--seq-len`` unless ``seq_len``
    divides ``tokens`` and both are positive."""
    if seq_len < 1:
        raise ValueError(f"--seq-len {seq_len}: must be a positive number of tokens")
    if tokens < seq_len or tokens % seq_len:
        raise ValueError(f"--tokens {tokens}: must be a positive multiple of --seq-len {seq_len}")
    return tokens // seq_len


def default_bound(model_cfg: Any, seq_len: int, max_abs_logit: float) -> tuple[float, str]:
    """The bound on ``max |Δlogit|`` and its derivation in one line.

    fp32 rounds each operation with relative error ``u = 2^-24``; a reduction of length ``n`` then
    has relative error about ``sqrt(n) u`` (probabilistic rounding analysis: independent rounding
    errors add in quadrature). A logit passes through ``P = 14 L + 2`` such reductions in sequence
    (:data:`STAGES_PER_LAYER`, :data:`HEAD_STAGES`); their independent errors add in quadrature to
    ``sqrt(P n) u`` for ``n`` the longest reduction (hidden, FFN, LoRA ranks, heads x v_head_dim,
    and ``seq_len`` keys for ``p·v``). Two implementations differ by up to twice that, times
    :data:`GROWTH` for amplification through the network, relative to the logits' scale
    ``max |logit|``: ``bound = 2 * 8 * u * sqrt(P n) * max |logit|``."""
    lengths = [model_cfg.hidden_size, model_cfg.ffn_hidden_size, model_cfg.q_lora_rank, model_cfg.kv_lora_rank,
               model_cfg.num_attention_heads * model_cfg.v_head_dim, seq_len]
    if model_cfg.num_moe_experts:
        lengths.append(model_cfg.moe_ffn_hidden_size)
    n = max(int(x) for x in lengths if x)
    stages = STAGES_PER_LAYER * int(model_cfg.num_layers) + HEAD_STAGES
    bound = IMPLEMENTATIONS * GROWTH * FP32_UNIT_ROUNDOFF * math.sqrt(stages * n) * max_abs_logit
    text = (f"= {IMPLEMENTATIONS} x {GROWTH} x 2^-24 x sqrt({stages} stages x {n}) x max |logit| "
            "(--max-delta overrides)")
    return bound, text


def token_batch(vocab_size: int, rows: int, seq_len: int, seed: int) -> torch.Tensor:
    """``[rows, seq_len]`` ids uniform in ``[0, vocab_size)`` from a generator seeded ``seed``."""
    return torch.randint(0, vocab_size, (rows, seq_len), generator=torch.Generator().manual_seed(seed))


def build_our_model(model_cfg: Any) -> Any:
    """Our ``GPTModel`` for the ``model`` group ``model_cfg`` on CPU, float32, in eval mode."""
    from omegaconf import OmegaConf

    from recipes.config.megatron import to_transformer_config
    from recipes.config.schema import Config
    from recipes.config.typed import to_config
    from recipes.train.model import build_gpt_model

    cfg = to_config(OmegaConf.merge(OmegaConf.structured(Config), {"model": model_cfg, "precision": {"dtype": "fp32"}}))
    return build_gpt_model(cfg, to_transformer_config(cfg)).float().eval()


def load_mapped_hf(model: Any, model_cfg: Any, reader: HFReader, skip_mtp: bool = False) -> None:
    """Load the HF tensors of ``reader`` into ``model`` through the import's tensor maps
    (:func:`recipes.hf.mapping.build_mapping`), in memory; every model tensor comes from the
    checkpoint and every checkpoint tensor is used (:func:`recipes.hf.mapping.check_hf_names`),
    the MTP layers past the model's excepted with ``skip_mtp``."""
    mapping = build_mapping(model_cfg)
    check_hf_names(mapping, reader.names(), skip_mtp)
    own = model.state_dict()
    tensors = {k for k, v in own.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    by_name = {m.megatron: m for m in mapping.maps}
    if tensors != set(by_name):
        raise KeyError(f"model and mapping disagree: model only {sorted(tensors - set(by_name))}, "
                       f"mapping only {sorted(set(by_name) - tensors)}")
    state = dict(own)
    for name, m in by_name.items():
        tensor = m.conversion.to_megatron([reader.get(h) for h in m.hf])
        if tensor.numel() != own[name].numel():
            raise ValueError(f"{m.hf} -> {name}: shape {tuple(tensor.shape)}, the model expects {tuple(own[name].shape)}")
        state[name] = tensor.reshape(own[name].shape).float()
    model.load_state_dict(state, strict=True)


def load_transformers(hf_dir: str | os.PathLike, hf_config: dict[str, Any], fam: HFFamily,
                      reader: HFReader, num_layers: int) -> Any:
    """transformers' model of ``hf_dir`` in float32, eval mode; ``KeyError`` naming any checkpoint
    tensor its load leaves out (beyond MTP layers and :attr:`HFFamily.not_loaded`) or initialises."""
    import transformers

    model, info = getattr(transformers, fam.model_class).from_pretrained(
        hf_dir, dtype=torch.float32, output_loading_info=True)

    def expected_unused(name: str) -> bool:
        layer = layer_index(name)
        return (layer is not None and layer >= num_layers) or any(re.search(p, name) for p in fam.not_loaded)

    unexpected = sorted(n for n in info.get("unexpected_keys", ()) if not expected_unused(n))
    missing = sorted(info.get("missing_keys", ()))
    mismatched = sorted(str(k) for k in info.get("mismatched_keys", ()))
    if unexpected or missing or mismatched:
        raise KeyError(f"transformers' {fam.model_class} does not load {hf_dir} as is: unexpected {unexpected[:10]}, "
                       f"missing (left at their initial values) {missing[:10]}, mismatched {mismatched[:10]}")
    return model.float().eval()


def our_logits(model: Any, ids: torch.Tensor, packed: bool) -> torch.Tensor:
    """``[rows, seq_len, vocab]`` logits of our model; ``packed``: the rows as documents of one THD row."""
    from megatron.core.packed_seq_params import PackedSeqParams

    rows, seq = ids.shape
    positions = torch.arange(seq)
    if not packed:
        return model(ids, positions[None].expand(rows, -1), None)
    cu = torch.arange(0, (rows + 1) * seq, seq, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=seq, max_seqlen_kv=seq)
    out = model(ids.reshape(1, -1), positions.repeat(rows)[None], None, packed_seq_params=params)
    return out.reshape(rows, seq, -1)


def compare(ours: torch.Tensor, ref: torch.Tensor, model_cfg: Any, packed: bool,
            max_delta: float | None) -> Report:
    """The :class:`Report` of logits ``ours`` against ``ref`` (both ``[rows, seq_len, vocab]``)."""
    diff = (ours.double() - ref.double()).abs()
    flat = int(diff.argmax())
    at = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    max_abs_logit = float(ref.abs().max())
    bound, text = default_bound(model_cfg, ref.shape[1], max_abs_logit)
    if max_delta is not None:
        bound, text = max_delta, "(--max-delta)"
    agree = int((ours.argmax(-1) == ref.argmax(-1)).sum())
    per_position = diff.amax(-1)
    over = per_position > bound
    over_bound = tuple((int(r), int(p)) for r, p in over.nonzero().tolist())
    elsewhere = float(per_position[~over].max()) if bool((~over).any()) else 0.0
    return Report(rows=ref.shape[0], seq_len=ref.shape[1], packed=packed, max_abs_diff=float(diff.max()),
                  mean_abs_diff=float(diff.mean()), max_at=at, top1_agree=agree, positions=ref.shape[0] * ref.shape[1],
                  max_abs_logit=max_abs_logit, bound=bound, bound_derivation=text, over_bound=over_bound,
                  max_abs_diff_elsewhere=elsewhere)


def verify(hf_dir: str | os.PathLike, model_cfg: Any, ckpt: str | os.PathLike | None = None,
           tokens: int = DEFAULT_TOKENS, seq_len: int = DEFAULT_SEQ_LEN, seed: int = 0, packed: bool = False,
           max_delta: float | None = None, skip_mtp: bool = False, log: Callable[[str], None] = print) -> Report:
    """Run the token batch through transformers' model of ``hf_dir`` and our model of ``model_cfg``
    (the ``model`` group: the checkpoint's with ``ckpt``, else derived from ``hf_dir``'s
    config.json) with weights from ``ckpt`` (a megatron checkpoint) or, without it, from
    ``hf_dir`` through the import's tensor maps (``skip_mtp``: as ``import --skip-mtp``, without the
    checkpoint's MTP layers). Every input is checked before a model is built."""
    hf_config = read_hf_config(hf_dir)
    fam = family(hf_config, hf_dir)
    rows = check_tokens(tokens, seq_len)
    if max_delta is not None and not max_delta >= 0:
        raise ValueError(f"--max-delta {max_delta}: must be a non-negative number")
    if ckpt is not None:
        check_same_model(model_cfg, hf_config, ckpt, hf_dir, skip_mtp)
    reader = HFReader(hf_dir)
    try:
        if model_cfg.dsa_indexer_topk and seq_len <= model_cfg.dsa_indexer_topk:
            log(f"note: --seq-len {seq_len} <= index_topk {model_cfg.dsa_indexer_topk}: every query selects all "
                "its keys, so the indexer's top-k selection is not exercised")
        ours = build_our_model(model_cfg)
        if ckpt is None:
            load_mapped_hf(ours, model_cfg, reader, skip_mtp)
        else:
            from recipes.checkpoint.store import load_weights

            load_weights(ckpt, ours)
        ref_model = load_transformers(hf_dir, hf_config, fam, reader, int(model_cfg.num_layers))
        ids = token_batch(int(model_cfg.vocab_size), rows, seq_len, seed)
        source = f"--ckpt {ckpt}" if ckpt is not None else f"{hf_dir} mapped in memory"
        log(f"verify: {rows} x {seq_len} tokens (seed {seed}{', packed as THD documents' if packed else ''}), "
            f"CPU float32: transformers {fam.model_class} vs ours ({source})")
        with torch.no_grad():
            ref = fam.logits(ref_model, ids, reader, hf_config).float()
            got = our_logits(ours, ids, packed).float()
    finally:
        reader.close()
    if got.shape != ref.shape:
        raise ValueError(f"logits shapes differ: ours {tuple(got.shape)}, transformers {tuple(ref.shape)}")
    report = compare(got, ref, model_cfg, packed, max_delta)
    for line in report.lines():
        log(line)
    return report
