"""GLM-5.x attention layers for megatron-core: DSA lightning indexer with KPool, sparse absorbed MLA,
precision policy and top-k drift metrics. Knows torch and megatron-core, never Hydra or wandb."""
