"""ftsdp.examples: what the main job trains by default.

- :mod:`ftsdp.examples.gpt`: a small GPT-2-like decoder.
- :mod:`ftsdp.examples.data`: a deterministic synthetic language and windows over a token file.
"""
