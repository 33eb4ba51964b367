"""KDA's float32-born parameters (conv weights, ``dt_bias``, ``A_log``) in a BF16 model: they sit
in the BF16 parameter buffer with every other parameter, so megatron's distributed optimizer can
shard and save their state (an FP32 parameter inside a BF16 model fails megatron 0.19.2's
``sharded_param_state_dp_reshardable`` shape check), and the layer still computes them in FP32."""

from __future__ import annotations

import torch

from tests.test_config import _compose


def test_bf16_hybrid_model_saves_its_distributed_optimizer_state(single_rank_parallel_state) -> None:
    """glm5_3_flash_tiny in bf16 (``Float16Module``, megatron's DDP and distributed optimizer):
    one optimizer step, then the checkpoint's sharded optimizer state."""
    from recipes.checkpoint.store import OPTIMIZER_SHARDING, unwrap
    from recipes.config.typed import to_config
    from recipes.loop import _build as build_trainer

    cfg = to_config(_compose(["model=glm5_3_flash_tiny", "precision=bf16", "data.seq_length=32"]))
    assert cfg.parallelism.use_distributed_optimizer
    trainer = build_trainer(cfg)
    gen = torch.Generator().manual_seed(1)
    tokens, labels = (torch.randint(0, cfg.model.vocab_size, (1, 32), generator=gen) for _ in range(2))
    trainer.model(tokens, torch.arange(32)[None], None, labels=labels).sum().backward()
    trainer.model.finish_grad_sync()
    trainer.optimizer.step()
    model = unwrap(trainer.model)
    state = trainer.optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=False,
                                                 metadata=OPTIMIZER_SHARDING)
    assert state
    kda = model.decoder.layers[0].self_attention
    assert type(kda).__name__ == "KimiDeltaAttention"
    assert {getattr(kda, n).dtype for n in ("conv_q", "conv_k", "conv_v", "dt_bias", "A_log")} == {torch.bfloat16}
