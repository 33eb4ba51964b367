"""Starting and ending a run: the console, the distributed set-up, the run directory, the run result and preemption handling."""
