"""Corpus formats, the manifest job (Beam) and the keyed Grain loader; the PyTorch-side loaders'
adapters (loaders) and the replay of a loader's plan.

The public face (`__all__`): the modules siblings may import; `workers` (the loader's worker
processes' set-up) is the pipeline's own."""

__all__ = ["beam_filesystems", "corpus", "formats", "grain_attach", "loader", "loader_config",
           "loaders", "manifest", "manifest_file", "olmo", "progress", "replay", "runners",
           "shadow", "synth", "text"]
