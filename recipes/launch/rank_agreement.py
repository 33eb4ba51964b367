"""Ranks agree on the config before they work.

Every rank of a launch composes its config on its own (its own command line and environment). Ranks
with different configs used to hang in a collective one of them never reaches (different
``train.steps``, parallel layouts) or die in gloo with "Connection reset by peer" (different
shapes). :func:`check_ranks_agree` runs right after the process group starts, before any
config-dependent collective: every rank hashes its composed config (sha256 of the sorted JSON),
the hashes are all-gathered over a gloo group with a bounded timeout, and on a mismatch the flat
configs are gathered too, so that every rank raises :class:`RankConfigMismatch` naming each
differing key with its value on every rank.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from typing import Any

import torch.distributed as dist

TIMEOUT_S = 300.0
"""How long a rank waits for the others to reach the comparison (they all just met at the
rendezvous, so the skew is the time to compose a config)."""
SHOWN_KEYS = 12


class RankConfigMismatch(RuntimeError):
    """The ranks of one launch composed different configs."""


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}."))
    return out


def _digest(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def differing_keys(flats: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Every dotted key whose value is not the same on all ranks -> its value on each rank
    (``"<missing>"`` where a rank lacks it), sorted by key."""
    keys = sorted(set().union(*flats))
    diff = {}
    for key in keys:
        values = [f.get(key, "<missing>") for f in flats]
        if any(v != values[0] for v in values[1:]):
            diff[key] = values
    return diff


def check_ranks_agree(config: dict[str, Any], timeout_s: float = TIMEOUT_S) -> None:
    """Collective over the default process group (a no-op without one or alone): raise
    :class:`RankConfigMismatch` on every rank when the ranks' ``config`` (the plain composed
    config) differ, or when a rank does not reach the comparison within ``timeout_s``."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    digests: list[Any] = [None] * world
    group = None
    try:
        try:  # creating the group is collective too: a missing rank shows in either
            group = dist.new_group(backend="gloo", timeout=_dt.timedelta(seconds=timeout_s))
            dist.all_gather_object(digests, _digest(config), group=group)
        except RuntimeError as err:  # torch's DistStoreError / DistBackendError
            raise RankConfigMismatch(
                f"rank {rank}: not every rank reached the config comparison within {timeout_s:g} s "
                f"(a rank that failed or was started with another command?): "
                f"{(str(err).strip().splitlines() or [''])[0]}") from err
        if len(set(digests)) == 1:
            return
        flats: list[Any] = [None] * world
        dist.all_gather_object(flats, _flat(config), group=group)
    finally:
        if group is not None:
            dist.destroy_process_group(group)
    diff = differing_keys(flats)
    shown = "; ".join(f"{key}: " + ", ".join(f"rank {r}={v!r}" for r, v in enumerate(values))
                      for key, values in list(diff.items())[:SHOWN_KEYS])
    more = f" and {len(diff) - SHOWN_KEYS} more keys" if len(diff) > SHOWN_KEYS else ""
    raise RankConfigMismatch(
        f"the ranks of this launch composed different configs ({len(set(digests))} distinct; "
        f"{len(diff)} differing key(s): {shown}{more}). Every rank must run the same command "
        "and environment; nothing was trained")
