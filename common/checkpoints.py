"""Is a checkpoint whole? damage(path) reads its files' structure, before anything heavy starts
(--resume checks before vLLM does; a save is read back before a message recommends it).

Checked: every JSON file parses; trainer_state.pt is a whole zip (torch.save's format) with every
member's CRC; every *.safetensors has a header that parses and data of exactly the size the header
says; each model folder has its weights; optimizer/ (torch.distributed.checkpoint) has metadata that
loads and, for every item it lists, a shard long enough to hold it, each item a zip (torch.save)
whose members of at most CRC_MAX_BYTES pass their CRC (the pickled parts, and small tensors). Not
checked: the bytes of larger optimizer tensors and of the model weights, which no format here
checksums (a flipped bit there loads as another value, as from any safetensors file).
"""

from __future__ import annotations

import io
import json
import struct
import zipfile
from pathlib import Path

CRC_MAX_BYTES = 16 << 20


def damage(path: str) -> str | None:
    """None for a whole checkpoint, else what is damaged: "FILE: why" (FILE relative to path)."""
    root = Path(path)
    for file in sorted(root.rglob("*.json")):
        try:
            json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            return f"{file.relative_to(root)}: not JSON ({type(e).__name__}: {str(e)[:80]})"
    why = _zip_damage(root / "trainer_state.pt", 0, None)
    if why:
        return f"trainer_state.pt: {why}"
    for folder in sorted(p.parent for p in root.glob("*/config.json")) + \
            sorted(p.parent for p in root.glob("*/adapter_config.json")):
        if not list(folder.glob("*.safetensors")) and not list(folder.glob("*.bin")):
            return f"{folder.relative_to(root)}/: no weights file"
    for file in sorted(root.rglob("*.safetensors")):
        why = _safetensors_damage(file)
        if why:
            return f"{file.relative_to(root)}: {why}"
    return _optimizer_damage(root, root / "optimizer")


def _safetensors_damage(file: Path) -> str | None:
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than a safetensors header"
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            return f"truncated: its header says {n} bytes, the file has {size - 8} after the length"
        try:
            header = json.loads(f.read(n))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            return f"its header does not parse ({type(e).__name__})"
    if 8 + n + end != size:
        return f"truncated: its tensors need {end} bytes of data, the file holds {size - 8 - n}"
    return None


def _optimizer_damage(root: Path, folder: Path) -> str | None:
    from torch.distributed.checkpoint import FileSystemReader

    where = folder.relative_to(root)
    if not (folder / ".metadata").is_file():
        return f"{where}/.metadata: missing"
    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # a truncated or overwritten pickle: any of several errors
        return f"{where}/.metadata: does not load ({type(e).__name__})"
    sizes = {}
    for item in (metadata.storage_data or {}).values():
        shard = folder / item.relative_path
        if item.relative_path not in sizes:
            sizes[item.relative_path] = shard.stat().st_size if shard.is_file() else None
        if sizes[item.relative_path] is None:
            return f"{where}/{item.relative_path}: missing"
        if item.offset + item.length > sizes[item.relative_path]:
            return (f"{where}/{item.relative_path}: truncated ({sizes[item.relative_path]} bytes, an item needs "
                    f"{item.offset + item.length})")
        why = _zip_damage(shard, item.offset, item.length)
        if why:
            return f"{where}/{item.relative_path}: the item at byte {item.offset}: {why}"
    return None


def _zip_damage(file: Path, offset: int, length: int | None) -> str | None:
    """Why the zip (torch.save's format) at offset in file, length bytes (None: to the end), is not
    whole: its directory must read and each member of at most CRC_MAX_BYTES pass its CRC; a larger
    one is not read (its local header must be where the directory says)."""
    if not file.is_file():
        return "missing"
    with open(file, "rb") as f:
        end = f.seek(0, io.SEEK_END) if length is None else offset + length
        try:
            with zipfile.ZipFile(_Slice(f, offset, end)) as z:
                for member in z.infolist():
                    if member.file_size <= CRC_MAX_BYTES:
                        with z.open(member) as m:  # reading to the end checks its CRC
                            while m.read(1 << 20):
                                pass
                    else:
                        f.seek(offset + member.header_offset)
                        if f.read(4) != b"PK\x03\x04":
                            return f"member {member.filename} is not where the directory says"
        except Exception as e:  # BadZipFile (a bad CRC too), NotImplementedError (a garbled method), ...
            return f"not a whole zip ({type(e).__name__}: {str(e)[:80]})"
    return None


class _Slice(io.RawIOBase):
    """Bytes [start, end) of an open file, as a file of their own (zipfile seeks in it)."""

    def __init__(self, f, start: int, end: int):
        self.f, self.start, self.end, self.pos = f, start, end, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.end - self.start}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        self.f.seek(self.start + self.pos)
        n = self.f.readinto(memoryview(buffer)[:max(0, min(len(buffer), self.end - self.start - self.pos))])
        self.pos += n
        return n
