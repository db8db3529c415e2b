"""What reading a data source kept and dropped (train/data/sources.py, train/data/json_records.py): its own
module, so that the readers and the loader share it without importing each other."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class SourceReport:
    """What loading a source kept and dropped, with reasons."""

    source: str
    records_read: int = 0  # complete records decoded from the file
    conversations: int = 0  # kept
    file_truncated: bool = False  # the file ended inside a record (that record was lost)
    truncated_at_char: int | None = None
    stopped_at_limit: bool = False  # reading stopped early because `limit` conversations were kept
    dropped_turns: dict[str, int] = field(default_factory=dict)  # reason -> count ("unknown_role:<r>", ...)
    dropped_conversations: dict[str, int] = field(default_factory=dict)  # reason -> count
    renamed_duplicate_ids: int = 0
    format: str | None = None  # FORMATS
    first_dropped: dict[str, str] = field(default_factory=dict)  # reason -> the first record dropped for it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        parts = [f"{self.source}: kept {self.conversations} of {self.records_read} records"]
        if self.file_truncated:
            parts.append(f"file is truncated (cut at char {self.truncated_at_char}; complete records salvaged)")
        if self.stopped_at_limit:
            parts.append("stopped at limit")
        if self.dropped_conversations:
            parts.append("dropped conversations " + ", ".join(f"{k}={v}" for k, v in sorted(self.dropped_conversations.items())))
        if self.dropped_turns:
            parts.append("dropped turns " + ", ".join(f"{k}={v}" for k, v in sorted(self.dropped_turns.items())))
        if self.renamed_duplicate_ids:
            parts.append(f"{self.renamed_duplicate_ids} repeated ids renamed to id#n")
        return "; ".join(parts)
