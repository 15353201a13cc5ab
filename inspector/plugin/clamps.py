"""One hook's feature-clamp tables on the device (``hookpoints.clamp_delta`` reads them in the graph).

The features an intervention set clamps at a hook are its *directions* (encoder and decoder rows, the
activation's offset and floor), written when the set changes; each intervention slot then says which
directions it clamps and to what value, written with the slot's scale and bias. Rows whose slot clamps
nothing get a delta of exactly zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inspector.core.interventions import FeatureClamp, Intervention

from .uploads import upload

TENSORS = ("clamp_encoder", "clamp_decoder", "clamp_offset", "clamp_floor", "clamp_value", "clamp_on")


@dataclass
class ClampTable:
    encoder: torch.Tensor  # [clamps, width]
    decoder: torch.Tensor  # [clamps, width]
    offset: torch.Tensor  # [clamps]
    floor: torch.Tensor  # [clamps]
    value: torch.Tensor  # [slots, clamps]
    on: torch.Tensor  # [slots, clamps]: 1 where the slot clamps that direction
    directions: dict = field(default_factory=dict)  # FeatureClamp.direction -> its row

    @classmethod
    def allocate(cls, clamps: int, slots: int, width: int, dtype: torch.dtype, device: torch.device) -> "ClampTable":
        def zeros(*shape):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(zeros(clamps, width), zeros(clamps, width), zeros(clamps), zeros(clamps), zeros(slots, clamps),
                   zeros(slots, clamps))

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(zip(TENSORS, (self.encoder, self.decoder, self.offset, self.floor, self.value, self.on)))

    def set_directions(self, clamps: list[FeatureClamp]) -> None:
        """The features this hook's interventions clamp (at most as many as the table holds, checked by
        the caller); every slot clamps nothing until written."""
        self.directions = {}
        for clamp in clamps:
            row = self.directions.setdefault(clamp.direction, len(self.directions))
            for tensor, data in ((self.encoder, clamp.encoder), (self.decoder, clamp.decoder)):
                tensor[row].copy_(torch.tensor(data))  # the vectors are read-only
            self.offset[row], self.floor[row] = clamp.offset, clamp.floor
        self.on.zero_()

    def write_slot(self, slot: int, interventions: list[Intervention]) -> None:
        """Slot ``slot`` clamps what ``interventions`` clamp (a later clamp of a feature wins)."""
        on, value = torch.zeros(self.on.shape[1], dtype=self.on.dtype), torch.zeros(self.value.shape[1], dtype=self.value.dtype)
        for iv in interventions:
            if iv.clamp is not None:
                row = self.directions[iv.clamp.direction]
                on[row], value[row] = 1, iv.clamp.value
        upload(self.on[slot], on)  # whole rows from the host: no per-element copy waiting for the device
        upload(self.value[slot], value)
