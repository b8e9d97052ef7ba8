"""What a run reports: MFU, memory, the console, metrics.jsonl, TensorBoard, trackers, profiles."""
