"""Writing outputs so that a destination is never left half-written."""
