"""Trace templates of aotinfer's ops (see template.py) and the registry of traced ops."""

from .template import Const, Scalar, Tensor, TraceTemplate, Var, attach_trace, templates_of

__all__ = ["Const", "Scalar", "Tensor", "TraceTemplate", "Var", "register", "registry", "templates_of"]

#: Every (op, template or dispatch function) registered by @aotinfer_api(trace=...).
_REGISTRY: list = []


def register(op, trace) -> None:
    """Give ``op`` its ``.trace(...)`` and enter it in the registry (done by @aotinfer_api)."""
    attach_trace(op, trace)
    _REGISTRY.append((op, trace))


def registry():
    """Every (op, template) pair registered by @aotinfer_api(trace=...), dispatchers expanded."""
    return [(op, template) for op, trace in _REGISTRY for template in templates_of(trace)]
