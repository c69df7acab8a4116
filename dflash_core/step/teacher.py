"""The teacher's logits of a loss's rows, chunk by chunk.

A row is a block position; its teacher is the target's next-token distribution at the context
position before the row's label. Blocks overlap (anchors closer together than a block's length),
so at the recipe's density a micro-batch has more rows than context positions: 512 anchors with
15 drafted positions each are 7,680 rows over at most 3,072 positions. Then the teacher's logits
are formed once per context position (one [S, V] table, one GEMM of S rows) and each chunk of
rows gathers its rows from it; a gather of a row costs a small fraction of its GEMM. With fewer
rows than positions (sparse anchors), each chunk forms its rows' logits as before. Which one is
decided by the shapes, which are fixed for an engine, so a recorded step graph holds one of them.
"""

from __future__ import annotations

import torch


class TeacherLogits:
    """The teacher's logits of rows [start, end) of a loss (`chunk`), in the LM head's dtype."""

    def __init__(self, hidden: torch.Tensor, positions: torch.Tensor | None, lm_head_weight: torch.Tensor):
        """hidden: the rows' teacher hidden states [R, H] (positions None), or the target's
        final hidden states of every context position [S, H] with each row's position [R]."""
        self.hidden, self.positions, self.weight = hidden, positions, lm_head_weight
        self._table: torch.Tensor | None = None

    @classmethod
    def of_rows(cls, hidden_rows: torch.Tensor, lm_head_weight: torch.Tensor) -> TeacherLogits:
        return cls(hidden_rows, None, lm_head_weight)

    @classmethod
    def at_positions(cls, hidden: torch.Tensor, positions: torch.Tensor, lm_head_weight: torch.Tensor) -> TeacherLogits:
        """Rows at context positions of hidden [S, H]: per context position where there are
        fewer positions than rows, else per row."""
        if hidden.shape[0] < positions.shape[0]:
            return cls(hidden, positions, lm_head_weight)
        return cls.of_rows(hidden[positions], lm_head_weight)

    @property
    def per_position(self) -> bool:
        return self.positions is not None

    def hidden_rows(self) -> torch.Tensor:
        """The rows' teacher hidden states [R, H] (dense references in tests)."""
        return self.hidden if self.positions is None else self.hidden[self.positions]

    def chunk(self, start: int, end: int) -> torch.Tensor:
        """Logits [end - start, V] of rows [start, end)."""
        w = self.weight
        if self.positions is None:
            return self.hidden[start:end].to(w.dtype) @ w.t()
        if self._table is None:  # formed at the first chunk, inside the loss's forward
            self._table = self.hidden.to(w.dtype) @ w.t()
        return self._table.index_select(0, self.positions[start:end])

    def release(self) -> None:
        """Drop the table (after the loss's last chunk)."""
        self._table = None


def teacher_logits(teacher: torch.Tensor | TeacherLogits, lm_head_weight: torch.Tensor) -> TeacherLogits:
    """A TeacherLogits as it is, or one of rows' teacher hidden states [R, H]."""
    return teacher if isinstance(teacher, TeacherLogits) else TeacherLogits.of_rows(teacher, lm_head_weight)
