"""The manual engine: ``checkpoint``, ``checkpoint_sequential``, the per-module option (set or read
how one module runs, transformers layers included), and finding a model's blocks."""
