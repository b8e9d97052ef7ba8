"""A run's checkpoints and its output directory: saving, resuming, what a segment continues."""
