"""Transfer engines shipped with kvtier-core (registered as entry points), and what every
engine uses for loads of a range of layers (``TransferEngine.load(..., layers=(lo, hi))``):
the argument's check, the refusal of engines without ``capabilities().layer_ranges``, and the
handle of an empty ranged load."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidArgumentError, LayoutError, show_value
from ..interfaces import CompletedHandle


def check_layer_range(layers: Any, num_layers: int, backend: str = ""
                      ) -> tuple[int, int] | None:
    """``load``'s ``layers`` checked: None (every layer) or ``(lo, hi)``, a tuple or list of
    two ints (not bools) with ``0 <= lo < hi <= num_layers``, returned as a tuple of ints.
    Anything else is an InvalidArgumentError naming ``layers``, raised before anything is
    queued."""
    if layers is None:
        return None
    if not isinstance(layers, (tuple, list)) or len(layers) != 2 \
            or any(isinstance(x, bool) or not isinstance(x, int) for x in layers):
        raise InvalidArgumentError(f"{backend}: layers must be None or (lo, hi), two ints, got "
                                   f"{show_value(layers)}", argument="layers", value=layers)
    lo, hi = int(layers[0]), int(layers[1])
    if not 0 <= lo < hi <= num_layers:
        raise InvalidArgumentError(f"{backend}: layers ({lo}, {hi}) must satisfy 0 <= lo < hi "
                                   f"<= {num_layers} (the pool's layers)", argument="layers",
                                   value=layers)
    return lo, hi


def refuse_layer_range(layers: Any, backend: str) -> None:
    """What ``load`` of an engine without ``capabilities().layer_ranges`` does with
    ``layers``: nothing for None, an InvalidArgumentError for anything else."""
    if layers is not None:
        raise InvalidArgumentError(f"{backend}: this engine loads every layer of a page "
                                   "(capabilities().layer_ranges is False); pass layers=None, "
                                   f"got {show_value(layers)}", argument="layers", value=layers)


def check_handle_layer(layer: Any, lo: int, hi: int) -> None:
    """A handle of layers ``lo .. hi-1`` asked about ``layer``: LayoutError unless it is an
    int (not a bool) in that range."""
    if isinstance(layer, bool) or not isinstance(layer, int) or not lo <= layer < hi:
        raise LayoutError(f"layer {show_value(layer)} out of range [{lo}, {hi})")


class CompletedRangeHandle(CompletedHandle):
    """A finished load of layers ``lo .. hi-1`` (an empty one): ``wait_layer`` answers those
    layers and raises LayoutError for the others."""

    def __init__(self, num_layers: int, layers: tuple[int, int]):
        super().__init__(num_layers)
        self.layers = layers

    def wait_layer(self, layer: int) -> None:
        check_handle_layer(layer, *self.layers)


def completed_handle(num_layers: int, layers: tuple[int, int] | None) -> CompletedHandle:
    """The handle of an empty load of ``layers`` (None: every layer)."""
    return CompletedHandle(num_layers) if layers is None else CompletedRangeHandle(num_layers,
                                                                                   layers)
