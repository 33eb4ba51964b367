"""Hydra config tree; a package so that the installed kpool-train finds it as recipes.conf."""
