"""Building blocks of the offline CPU demo: a local SmolLM2 checkpoint and a small real dataset."""
