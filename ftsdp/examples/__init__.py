"""ftsdp.examples: what the main job trains by default, a small GPT (:mod:`ftsdp.examples.gpt`)
and a synthetic language or token-file windows (:mod:`ftsdp.examples.data`)."""
