"""Multi-head latent attention: the absorbed MLA layer and its rotary embedding."""
