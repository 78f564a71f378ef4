"""Corpus formats, the manifest job (Beam) and the keyed Grain loader."""
