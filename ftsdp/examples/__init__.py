"""ftsdp.examples: what the main job trains by default, a small GPT and its data."""
