"""In-tree backends, installed as ``dinfer_rt.backends.*``; each registers through the
public ``dinfer_rt.backends`` entry-point group exactly as a third-party plugin does."""
