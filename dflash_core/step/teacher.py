"""The teacher's logits of a loss's rows, chunk by chunk.

A row is a block position; its teacher is the target's next-token distribution at the context
position before the row's label. Blocks overlap (anchors closer together than a block's length),
so at the recipe's density a micro-batch has more rows than context positions: 512 anchors with
15 drafted positions each are 7,680 rows over at most 3,072 positions. Then the teacher's logits
are formed once per context position (one [S, V] table, one GEMM of S rows) and each chunk of
rows gathers its rows from it; a gather of a row costs a small fraction of its GEMM. With fewer
rows than positions (sparse anchors), each chunk forms its rows' logits as before. Which one is
decided by the shapes, which are fixed for an engine, so a recorded step graph holds one of them.

With an FP8 lm_head (fp8.Fp8Head, the "triton_fp8" loss kernel) the teacher's logits come from
FP8 GEMMs too: the teacher hidden states are cast to e4m3 once, with one scale over all of them
(the S positions' or the R rows'), so the table and the per-row logits of a row are the same
GEMM of the same e4m3 row; each chunk is then a view without the vocabulary's padding columns.

The Triton chunks read a chunk's rows as `TeacherRows`: the table itself with each row's index
into it (no gathered copy of the rows, which would be written and read once more) and the
logsumexp of every teacher row, formed once per table, so that a chunk's kernel needs no pass
over the teacher's logits for its normalizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..fp8 import FORWARD_DTYPE, Fp8Head, head_logits, quantize

Head = torch.Tensor | Fp8Head  # the lm_head [V, H], or it quantized once for FP8 GEMMs
RowLse = Callable[[torch.Tensor], torch.Tensor]  # logits [N, V] -> their logsumexp [N] fp32


@dataclass(frozen=True)
class TeacherRows:
    """A chunk's teacher logits as a kernel reads them: row i is logits[index[i]] (index None:
    logits[i]; every index a row of `logits`, which the kernel does not check); lse: the
    logsumexp of each row of `logits` [N] fp32, or None (not formed)."""

    logits: torch.Tensor
    index: torch.Tensor | None = None
    lse: torch.Tensor | None = None

    def dense(self) -> torch.Tensor:
        """The rows' logits [rows, V]."""
        return self.logits if self.index is None else self.logits.index_select(0, self.index)


def dense_logits(zt: torch.Tensor | TeacherRows) -> torch.Tensor:
    """A chunk's teacher logits [rows, V], given as they are or as TeacherRows."""
    return zt.dense() if isinstance(zt, TeacherRows) else zt


class TeacherLogits:
    """The teacher's logits of rows [start, end) of a loss (`chunk`), in the LM head's dtype
    (bf16 for an Fp8Head)."""

    def __init__(self, hidden: torch.Tensor, positions: torch.Tensor | None, lm_head: Head):
        """hidden: the rows' teacher hidden states [R, H] (positions None), or the target's
        final hidden states of every context position [S, H] with each row's position [R]."""
        self.hidden, self.positions, self.weight = hidden, positions, lm_head
        self._table: torch.Tensor | None = None
        self._table_lse: torch.Tensor | None = None
        self._fp8: tuple[torch.Tensor, torch.Tensor] | None = None  # the rows in e4m3, inverse scale

    @classmethod
    def of_rows(cls, hidden_rows: torch.Tensor, lm_head: Head) -> TeacherLogits:
        return cls(hidden_rows, None, lm_head)

    @classmethod
    def at_positions(cls, hidden: torch.Tensor, positions: torch.Tensor, lm_head: Head) -> TeacherLogits:
        """Rows at context positions of hidden [S, H]: per context position where there are
        fewer positions than rows, else per row."""
        if hidden.shape[0] < positions.shape[0]:
            return cls(hidden, positions, lm_head)
        return cls.of_rows(hidden[positions], lm_head)

    @property
    def per_position(self) -> bool:
        return self.positions is not None

    def hidden_rows(self) -> torch.Tensor:
        """The rows' teacher hidden states [R, H] (dense references in tests)."""
        return self.hidden if self.positions is None else self.hidden[self.positions]

    def chunk(self, start: int, end: int) -> torch.Tensor:
        """Logits [end - start, V] of rows [start, end)."""
        return self.rows(start, end).dense()

    def rows(self, start: int, end: int, lse: RowLse | None = None) -> TeacherRows:
        """Rows [start, end) as TeacherRows: per context position the table with the rows'
        positions, else the rows' own logits; with their logsumexp where `lse` forms it."""
        if self.positions is None:
            logits = self._logits(start, end)
            return TeacherRows(logits, None, lse(logits) if lse is not None else None)
        if self._table is None:  # formed at the first chunk, inside the loss's forward
            self._table = self._logits(0, self.hidden.shape[0])
        if lse is not None and self._table_lse is None:
            self._table_lse = lse(self._table)
        return TeacherRows(self._table, self.positions[start:end], self._table_lse if lse is not None else None)

    def _logits(self, start: int, end: int) -> torch.Tensor:
        """Logits of hidden[start:end] (its rows, or its positions for the table)."""
        w = self.weight
        if not isinstance(w, Fp8Head):
            return self.hidden[start:end].to(w.dtype) @ w.t()
        if self._fp8 is None:  # cast once, at the first chunk: one scale for every row
            self._fp8 = quantize(self.hidden, FORWARD_DTYPE)
        h8, inv = self._fp8
        return head_logits(h8[start:end], inv, w)

    def release(self) -> None:
        """Drop the table and the FP8 rows (after the loss's last chunk)."""
        self._table = None
        self._table_lse = None
        self._fp8 = None


def teacher_logits(teacher: torch.Tensor | TeacherLogits, lm_head: Head) -> TeacherLogits:
    """A TeacherLogits as it is, or one of rows' teacher hidden states [R, H]."""
    return teacher if isinstance(teacher, TeacherLogits) else TeacherLogits.of_rows(teacher, lm_head)
