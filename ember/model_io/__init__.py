"""Models in and out: detecting a path's format, loading it, HF directories, exports."""
