"""GComp: near-lossless gradient compression (Li et al., SoCC '24); see :mod:`.codec`."""

from hopq.codecs.gcomp.codec import GComp, GCompConfig, GCompPlan

__all__ = ["GComp", "GCompConfig", "GCompPlan"]
