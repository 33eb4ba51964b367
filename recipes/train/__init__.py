"""What a training step is made of: the model builder, data, data checks, the optimizer, CUDA graphs and non-finite handling."""
