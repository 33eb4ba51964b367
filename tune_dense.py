"""Scratch (not committed): dense-layout backward variants on a GPU."""
import json, sys, torch, triton
sys.path.insert(0, "scripts/bench")
from attention import _causal_indices
from kpool_layers.kernels import sparse_mla_dense_triton as dense
from kpool_layers.kernels.sparse_mla_triton import sparse_mla_triton

def inputs(s, n, d=576, v=512, w=2048):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(s, 1, n, d, device="cuda", generator=g).bfloat16().requires_grad_()
    kv = torch.randn(s, 1, 1, d, device="cuda", generator=g).bfloat16().requires_grad_()
    go = torch.randn(s, 1, n, v, device="cuda", generator=g).bfloat16()
    return q, kv, go, _causal_indices(s, w, torch.device("cuda"), s)

def run(q, kv, go, idx, layout):
    out = sparse_mla_triton(q, kv, idx, 576 ** -0.5, v_channels=512, layout=layout)
    return (out, *torch.autograd.grad(out, (q, kv), go))

def times(q, kv, go, idx, layout):
    def fb():
        out = sparse_mla_triton(q, kv, idx, 576 ** -0.5, v_channels=512, layout=layout)
        torch.autograd.backward(out, go); q.grad = kv.grad = None
    return triton.testing.do_bench(fb, warmup=5, rep=60)

res = {}
base = dict(dense.CONFIGS["ds"])
for s in (4096, 8192):
    q, kv, go, idx = inputs(s, 16)
    ref = run(q, kv, go, idx, "gather")
    res[f"{s}/gather"] = times(q, kv, go, idx, "gather")
    dense.GEMM_BACKWARD = False
    res[f"{s}/dense_kernels"] = times(q, kv, go, idx, "dense")
    dense.GEMM_BACKWARD = True
    variants = [None, (64,64,64,4,3), (128,128,64,8,3), (64,128,64,8,3), (128,64,32,8,4), (128,64,64,8,2)] if s == 4096 else [None]
    for cfg in variants:
        dense.CONFIGS["ds"] = dict(base) if cfg is None else dict(BM=cfg[0], BN=cfg[1], BC=cfg[2], num_warps=cfg[3], num_stages=cfg[4])
        try:
            got = run(q, kv, go, idx, "dense")
            again = run(q, kv, go, idx, "dense")
            err = [((a.float()-b.float()).norm()/b.float().norm()).item() for a, b in zip(got, ref)]
            det = all(torch.equal(a, b) for a, b in zip(got, again))
            res[f"{s}/gemm/{cfg}"] = (times(q, kv, go, idx, "dense"), err, det)
        except Exception as e:
            res[f"{s}/gemm/{cfg}"] = str(e)[:300]
        print(s, cfg, res[f"{s}/gemm/{cfg}"], flush=True)
    dense.CONFIGS["ds"] = dict(base)
    for qc in (2, 8):
        dense.QUERY_CHUNKS = qc
        res[f"{s}/gemm/chunks{qc}"] = times(q, kv, go, idx, "dense"); print(qc, res[f"{s}/gemm/chunks{qc}"], flush=True)
    dense.QUERY_CHUNKS = 4
    print({k: v for k, v in res.items() if k.startswith(str(s))}, flush=True)
from torch.profiler import profile, ProfilerActivity
q, kv, go, idx = inputs(4096, 16)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        out = sparse_mla_triton(q, kv, idx, 576 ** -0.5, v_channels=512, layout="dense")
        torch.autograd.backward(out, go); q.grad = kv.grad = None
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
