"""Planning before anything is built: the dry run, the memory plan and the preflight checks."""
