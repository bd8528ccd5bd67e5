"""Graph passes run per backend before execution: cleanup, fusion (and, next, reordering)."""

from dinfer_rt.passes.manager import Pass, PassContext, PassManager, default_pipeline

__all__ = ["Pass", "PassContext", "PassManager", "default_pipeline"]
