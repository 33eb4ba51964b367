"""The run's configuration: the schema's declarations and checks, the key tables, typed access, the megatron transformer config made from it and the pipeline layout."""
