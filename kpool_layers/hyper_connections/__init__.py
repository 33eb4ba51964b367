"""Hyper-connections: mHC residual streams (GLM-5.3)."""
