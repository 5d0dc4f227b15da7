"""Key/value cache for incremental decoding, with a rolling buffer for sliding-window models.

With ``sliding_window`` set, each layer keeps only the last ``sliding_window`` keys and values
(Mistral's rolling buffer: position p lives in slot p mod W), so memory stays bounded however
long the generation; otherwise the buffer holds the whole sequence. A forward over new tokens
attends to the cached slots plus the new keys, masked by absolute positions (causal, window),
then writes the new keys into the buffer. All sequences of a batch share positions (prompts of
equal length).

Shape legend: B batch, G kv heads, C capacity (slots), S new tokens, T attended keys, K head_dim.
"""

from __future__ import annotations

import torch

from densetrain.errors import UserError
from densetrain.models.config import ModelConfig


class LayerKVCache:
    """One layer's buffers; ``update`` is called by that layer's attention."""

    def __init__(self, owner: KVCache, k_BGCK: torch.Tensor, v_BGCK: torch.Tensor) -> None:
        self._owner = owner
        self.k_BGCK = k_BGCK
        self.v_BGCK = v_BGCK

    def update(
        self, k_BGSK: torch.Tensor, v_BGSK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return cached + new keys/values ([B, G, T, K]) and store the new ones."""
        filled = self._owner.filled_slots
        k_BGTK = torch.cat([self.k_BGCK[:, :, :filled], k_BGSK], dim=2)
        v_BGTK = torch.cat([self.v_BGCK[:, :, :filled], v_BGSK], dim=2)
        slots_S, keep_from = self._owner.pending_slots()
        self.k_BGCK[:, :, slots_S] = k_BGSK[:, :, keep_from:].to(self.k_BGCK.dtype)
        self.v_BGCK[:, :, slots_S] = v_BGSK[:, :, keep_from:].to(self.v_BGCK.dtype)
        return k_BGTK, v_BGTK


class KVCache:
    """Per-layer key/value buffers for ``Transformer.forward(..., kv_cache=cache)``.

    Call the model with ``positions_BS`` set to the absolute positions of the new tokens, in
    order and without gaps (``densetrain.generate.generate`` does this).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        batch_size: int,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(
                f"batch_size and max_len must be positive, got {batch_size} and {max_len}"
            )
        self.rolling = config.sliding_window is not None and config.sliding_window < max_len
        self.capacity = config.sliding_window if self.rolling else max_len
        shape = (batch_size, config.num_kv_heads, self.capacity, config.head_dim)
        self.slot_positions_C = torch.full((self.capacity,), -1, dtype=torch.long, device=device)
        self._layers = [
            LayerKVCache(
                self,
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(config.num_layers)
        ]
        self.filled_slots = 0
        self.next_position = 0
        self._pending_S: torch.Tensor | None = None

    def layer(self, index: int) -> LayerKVCache:
        """The cache of layer ``index``."""
        return self._layers[index]

    def key_positions(self, q_positions_BS: torch.Tensor) -> torch.Tensor:
        """Positions of the keys the new queries will see: cached slots, then the new tokens.

        Called once per forward before the layers run; it also commits the previous forward.
        """
        self._commit()
        new_S = q_positions_BS[0]
        if (
            new_S[0].item() != self.next_position
            or new_S.numel() > 1
            and not bool((new_S.diff() == 1).all())
        ):
            raise ValueError(
                f"positions_BS must continue the cached sequence at {self.next_position} "
                f"without gaps, got {new_S.tolist()}"
            )
        if not self.rolling and self.next_position + new_S.numel() > self.capacity:
            raise UserError(
                f"KVCache max_len {self.capacity} exceeded: {self.next_position} cached + "
                f"{new_S.numel()} new"
            )
        self._pending_S = new_S
        keys_T = torch.cat([self.slot_positions_C[: self.filled_slots], new_S])
        return keys_T.unsqueeze(0).expand(q_positions_BS.shape[0], -1)

    def pending_slots(self) -> tuple[torch.Tensor, int]:
        """Slots the pending new tokens are written to, and the first new token that is kept
        (a rolling buffer keeps only the last ``capacity`` of a long chunk)."""
        new_S = self._pending_S
        keep_from = max(0, new_S.numel() - self.capacity)
        return new_S[keep_from:] % self.capacity, keep_from

    def _commit(self) -> None:
        if self._pending_S is None:
            return
        slots_S, keep_from = self.pending_slots()
        self.slot_positions_C[slots_S] = self._pending_S[keep_from:]
        self.next_position += self._pending_S.numel()
        self.filled_slots = min(self.next_position, self.capacity)
        self._pending_S = None
