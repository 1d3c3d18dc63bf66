"""Tensor, expert and attention-data parallelism over ``torch.distributed`` (see :mod:`.layout`)."""

from .layout import Layout, layout_of

__all__ = ["Layout", "layout_of", "create_engine"]


def create_engine(config):
    """The engine ``config`` describes (torch imported here)."""
    from .executor import create_engine as create

    return create(config)
