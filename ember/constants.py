"""Constants shared by ember.data (which writes them into batches) and ember.nn (which reads them)."""

# Labels equal to this add nothing to the loss (SFT prompts, padding): PyTorch's cross_entropy default.
IGNORE_INDEX = -100
