"""What a run reports: metrics, top-k drift and indexer-loss logging, the precision map and the sweep summary."""
