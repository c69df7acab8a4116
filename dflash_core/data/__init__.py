"""conversations (JSONL) -> tokens + assistant loss mask -> fixed-shape packing + anchors."""
