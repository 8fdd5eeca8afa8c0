"""Trace templates of aotinfer's ops (see template.py) and the registry of traced ops."""

from .template import Const, Scalar, Tensor, TraceTemplate, Var, templates_of

__all__ = ["Const", "Scalar", "Tensor", "TraceTemplate", "Var", "registry", "templates_of"]


def registry():
    """Every (op, template) pair registered by @aotinfer_api(trace=...), dispatchers expanded."""
    from ..api_logging import TRACE_REGISTRY

    return [(op, template) for op, trace in TRACE_REGISTRY for template in templates_of(trace)]
