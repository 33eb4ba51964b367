"""DeepSeek sparse attention (DSA) parts."""
