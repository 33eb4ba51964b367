"""kpool-recipes: megatron-core training recipes (the version below is the package's only one)."""

__version__ = "0.1.0"
