"""Graph passes run per backend before execution: cleanup, fusion and folding rules on one
rewrite engine (``rewrite.py``), instruction reordering (``reorder.py``), the pass manager."""

from dinfer_rt.passes.manager import Pass, PassContext, PassManager, default_pipeline

__all__ = ["Pass", "PassContext", "PassManager", "default_pipeline"]
