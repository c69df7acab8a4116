"""The regeneration decoder's static KV cache (decode.SlotDecoder), behind transformers' `Cache.update`."""

from __future__ import annotations

import torch


class SlotCache:
    """Static keys and values [slots, kv_heads, length, head_dim] per layer, behind transformers'
    `Cache.update`: while prefilling, the given rows' keys go to positions 0..T-1 of their slots
    and attention sees only the prompt; while decoding, every slot's one new key goes to that
    slot's position and attention gets the whole cache (the mask, or the slots' ranges, say which
    positions count). A decode step with prompt tokens riding in it (ride.py) has more rows than
    slots: `slot_of` names each row's slot, and where the attention reads the keys as given (a
    mask, not ranges that name each query's cache row) it gets each row's slot's keys, gathered."""

    def __init__(self, layers: int, slots: int, length: int, kv_heads: int, head_dim: int, device, dtype):
        shape = (slots, kv_heads, length, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.slot_index = torch.arange(slots, device=device)
        self.rows: torch.Tensor | None = None  # prefill: the slots of the rows
        self.positions: torch.Tensor | None = None  # decode: [rows] the position written
        self.slot_of: torch.Tensor | None = None  # decode: [rows] each row's slot (None: row i is slot i)
        self.gather = False  # decode with slot_of: the keys returned per row, not the whole cache
        self.write_kernel = False  # decode: the new rows written by kernels/slot_write.py

    def kernel_takes(self, dtype: torch.dtype) -> bool:
        """Whether kernels/slot_write.py launches here and takes this cache's decode writes (new
        rows in `dtype`, as the model's)."""
        try:
            from ..kernels import slot_write
        except ImportError:  # no Triton: the eager put
            return False
        k = self.keys[0]
        new = torch.empty((k.shape[0], k.shape[1], 1, k.shape[3]), dtype=dtype, device=k.device)
        return slot_write.runs_on(k.device) and slot_write.supports(k, self.values[0], new, new)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if self.rows is not None:
            t = key_states.shape[2]
            k[self.rows, :, :t] = key_states
            v[self.rows, :, :t] = value_states
            return key_states, value_states
        assert self.positions is not None
        rows = self.slot_of
        if self.write_kernel and _slot_write().supports(k, v, key_states, value_states, rows is not None):
            _slot_write().write_slots(k, v, key_states, value_states, self.positions, rows)
        else:
            at = self.slot_index if rows is None else rows
            k[at, :, self.positions] = key_states[:, :, 0]
            v[at, :, self.positions] = value_states[:, :, 0]
        if rows is not None and self.gather:
            return k[rows], v[rows]
        return k, v

    # what transformers may ask a cache besides update()
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def is_compileable(self) -> bool:
        return False


def _slot_write():
    """kernels/slot_write.py, imported where used (it imports Triton)."""
    from ..kernels import slot_write

    return slot_write
