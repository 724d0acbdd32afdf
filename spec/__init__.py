"""DDTree speculative decoding for Kimi K2.6: the DFlash drafter (`spec.drafter`), its checkpoints
(`spec.drafter_checkpoint`), the engine (`spec.engine`), the embedded default model (`spec.default_model`) and
the command line (`python -m spec.decode`)."""
