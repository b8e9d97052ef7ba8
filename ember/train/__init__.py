"""A run resolved and assembled, the engines it trains on, and the one Trainer's loop."""
