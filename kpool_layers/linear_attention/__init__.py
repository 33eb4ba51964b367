"""Linear-attention layers: KDA (Kimi delta attention), its delta-rule backends."""
