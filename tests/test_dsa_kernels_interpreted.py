"""A GLMSparseMLA layer built with ``dsa_kernels=triton`` equals the torch-backed layer on CPU, under
Triton's interpreter: output, every weight gradient and the sparse indexer loss (whose target comes
from the Triton forward's slot probabilities). fp32 throughout (the interpreter's bf16 ``tl.dot`` is
wrong), so the two layers differ only in fp32 summation order: relative error ~ sqrt(terms) * 2^-24
per result, bound 1e-4 over the layer's chained products. The indexer loss (a KL near 0 between
close distributions) is compared absolutely: its fp32 targets differ by ~1e-7 per entry and enter
weighted by |log(t/p)| + 1 = O(1), so |difference| <= 1e-6.

The interpreter must be on before triton is imported, so the comparison runs in a subprocess (this
module as a script) that prints its errors as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RTOL = 1e-4


def compare() -> dict[str, float]:
    """Largest relative errors of the triton layer against the torch layer per case."""
    import torch
    from megatron.core import parallel_state as ps
    import torch.distributed as dist

    from tests.conftest import free_port
    from tests.test_attention import build, thd, tiny_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    rel = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-30))  # noqa: E731
    errors = {}
    for kpool, packed in ((1, False), (2, True)):
        kw = dict(kv_lora_rank=16, qk_pos_emb_head_dim=16 if kpool == 1 else 0,
                  dsa_indexer_head_dim=16, dsa_indexer_kpool=kpool,
                  dsa_indexer_kpool_always_select_tail=kpool > 1, dsa_indexer_loss_coeff=1.0,
                  dsa_indexer_use_sparse_loss=True)
        torch.manual_seed(kpool)
        ref = build(tiny_config(**kw))
        ours = build(tiny_config(**kw, dsa_kernels="triton"))
        ours.load_state_dict(ref.state_dict())
        x = torch.randn(13, 1, 32)
        params = {"packed_seq_params": thd([0, 5, 13])} if packed else {}
        results = []
        for layer in (ref, ours):
            layer.train()
            out, _ = layer(x, None, **params)
            out.square().sum().backward()
            grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
            results.append((out, grads, layer.pop_indexer_loss()))
        (r_out, r_grads, r_loss), (o_out, o_grads, o_loss) = results
        case = f"kpool{kpool}{'_thd' if packed else ''}"
        errors[f"{case}/out"] = rel(o_out, r_out)
        errors[f"{case}/indexer_loss"] = abs(o_loss - r_loss)  # absolute: the KL is near 0
        errors[f"{case}/grads"] = max(rel(o_grads[n], g) for n, g in r_grads.items())
        errors[f"{case}/same_grads"] = float(set(o_grads) != set(r_grads))
    return errors


@pytest.fixture(scope="module")
def report() -> dict[str, float]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_triton_layer_equals_torch_layer(report: dict[str, float]) -> None:
    assert len(report) == 8
    for key, err in report.items():
        bound = 0 if key.endswith("same_grads") else 1e-6 if key.endswith("loss") else RTOL
        assert err <= bound, (key, err)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from kpool_layers.compat import cpu as _cpu

    _cpu.install()
    print(json.dumps(compare()))
