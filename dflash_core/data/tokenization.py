"""What a cache entry depends on besides its file: the tokenizer, the chat template and the
sequence length (Tokenization), and the entry's key that combines them with the file's identity.
Below both the chunk tasks that tokenize (chunks.py) and the corpus that stitches their results
into entries (prepare.py), which both take it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from .cache_entry import file_digest
from .sources import SourceFile, identity
from .tokenize import ChatTemplate

CACHE_VERSION = 3  # bump when the entry layout or the tokenization changes


@dataclass(frozen=True)
class Tokenization:
    """Everything a cache entry depends on besides the file."""

    tokenizer_dir: str  # a saved copy of the engine's tokenizer
    tokenizer_hash: str
    template: ChatTemplate
    seq_len: int

    def key(self, src: SourceFile) -> str:
        parts = {
            "version": CACHE_VERSION,
            "files": identity(src),
            "content": _content(src),
            "kind": src.kind,
            "tokenizer": self.tokenizer_hash,
            "template": self.template.template,
            "kwargs": [[k, v] for k, v in self.template.kwargs],
            "seq_len": self.seq_len,
        }
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _content(src: SourceFile) -> list[str]:
    """Digests of the content of every file behind a source (identity's files, in its order)."""
    return [file_digest(path) for path, _, _ in identity(src)]
