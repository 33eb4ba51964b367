"""DeepSeek sparse attention: the lightning indexer with KPool, top-k selection, sparse attention and its core, the indexer loss, top-k drift, context parallelism and the kernel backends."""
