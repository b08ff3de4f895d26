"""The store's objects: every stored content by sha256, as a loose file or inside a pack (as git keeps them).

Layout under `<state_dir>/objects/`:

    ab/cdef...            a loose object: the content whose sha256 is abcdef..., mode 0400
    pack/pack-<N>.pack    the raw contents of many objects, concatenated (no header, no compression)
    pack/pack-<N>.idx     JSON {"version": 1, "objects": {sha256: [offset, size]}}: where each one sits

`<N>` is the sha256 of the pack's sorted object names, so equal names mean equal contents. Creating
thousands of small files is what makes a first snapshot slow, so a batch of at least `PACK_MIN` new
objects is written as one pack; fewer stay loose (the warm snapshots of overlay iterations).

A pack is written under a temp name (a first snapshot streams into it while it scans, its pages sent
to disk as it goes) and fsynced, then its index is written atomically (temp, fsync, rename), then the
pack is renamed into place and the folder fsynced. A pack counts only when both files exist, so a
kill at any instant leaves a valid store; an index without its pack, a pack without its index and
temp files are ignored by readers and removed by `prune`. Every read of an object is checked against
its sha256 (refused as `object_corrupt`), loose or packed alike.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from typing import IO, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

from .common import (
    TEMP_PREFIX,
    Context,
    HelperFailure,
    atomic_write,
    fsync_dir,
    name_the_folder,
    remove_quietly,
    staged_file,
)

#: a batch with at least this many new objects becomes one pack (git's unpack limit is 100)
PACK_MIN = 64
#: a snapshot keeps, in memory, up to this many bytes of the new contents it read while hashing
KEEP_BYTES = 256 << 20
CHUNK = 1 << 20
#: a pack being written starts the disk writes of every this many bytes, so its final fsync has little left
WRITEBACK_BYTES = 8 << 20
SHA = re.compile(r"^[0-9a-f]{64}$")
PREFIX = re.compile(r"^[0-9a-f]{2}$")
PACK_NAME = re.compile(r"^pack-[0-9a-f]{64}\.(pack|idx)$")

Pause = Callable[[str], None]


def no_pause(point: str) -> None:
    """The default for ObjectStore's test hook: go on."""


# ---------------------------------------------------------------- reading and copying bytes


def hash_file(path: str) -> str:
    h = hashlib.sha256()
    for block in file_chunks(path):
        h.update(block)
    return h.hexdigest()


def read_to_end(fd: int, size: int) -> bytes:
    """All of an open file's bytes, in one read when it still has the `size` its stat gave."""
    data = os.read(fd, size + 1)
    if len(data) > size:  # it grew since: read on (the caller's stat check will not keep these bytes)
        data += b"".join(iter(lambda: os.read(fd, CHUNK), b""))
    return data


def file_chunks(path: str) -> Iterator[bytes]:
    with open(path, "rb") as f:
        yield from iter(lambda: f.read(CHUNK), b"")


class Incoming:
    """One object to store: its name, a reader of its bytes, and the refusal if they do not hash to it.

    `hashed` says the bytes are the very ones this process hashed to `sha` (immutable, in memory), so
    writing them needs no second hash.
    """

    def __init__(self, sha: str, read: Callable[[], Iterable[bytes]], refusal: Callable[[], HelperFailure],
                 hashed: bool = False) -> None:
        self.sha = sha
        self.read = read
        self.refusal = refusal
        self.hashed = hashed

    def pour(self, out: IO[bytes]) -> int:
        """Write the bytes to `out`; their size, or the refusal if they are not the content named `sha`."""
        h = None if self.hashed else hashlib.sha256()
        size = 0
        for block in self.read():
            if h is not None:
                h.update(block)
            out.write(block)
            size += len(block)
        if h is not None and h.hexdigest() != self.sha:
            raise self.refusal()
        return size


def changed_file(path: str) -> HelperFailure:
    return HelperFailure(
        "content_changed",
        "%s changed while it was read" % path,
        "retry once nothing writes to the package",
        path=path,
    )


def corrupt_object(sha: str, where: str) -> HelperFailure:
    return HelperFailure(
        "object_corrupt",
        "stored object %s (in %s) does not hash to its name" % (sha, where),
        "the host's store is damaged; snapshots that use this content cannot be restored",
        sha=sha,
        path=where,
    )


def staged(item: Incoming, folder: str, mode: int, durable: bool = True) -> Tuple[str, int]:
    """A temp file in `folder` with the item's checked bytes and `mode` (fsynced if durable); (path, size)."""
    return staged_file(folder, mode, item.pour, durable)


def sync_filesystem(folder: str) -> None:
    """syncfs(2) on the file system holding `folder` (only it, not every disk); os.sync() where unavailable."""
    try:
        import ctypes  # imported here: only a batch of new loose objects needs it

        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(folder, os.O_RDONLY)
        try:
            if libc.syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass
    os.sync()


def rmdir_quietly(folder: str) -> None:
    try:
        os.rmdir(folder)
    except OSError:
        pass  # not empty: it holds other objects


def other_half(path: str) -> str:
    """The pack of an index, the index of a pack."""
    return path[:-4] + ".pack" if path.endswith(".idx") else path[:-5] + ".idx"


def stat_key(st: os.stat_result) -> Tuple[int, int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


# ---------------------------------------------------------------- what a batch added


class Added:
    """What one batch wrote: counts for the answer, and the files to remove if the caller's step fails."""

    def __init__(self, objects: int = 0, size: int = 0, paths: Optional[List[str]] = None) -> None:
        self.objects = objects
        self.bytes = size
        self.paths = paths or []  # a pack's index comes before its pack: removing the index first uncounts it

    def undo(self) -> None:
        for path in self.paths:
            remove_quietly(path)
            rmdir_quietly(os.path.dirname(path))


class Collector:
    """Hashes package files for a snapshot's scan and stores the contents the store lacks as it reads them.

    A first snapshot then reads each file once instead of twice (hash, then copy). The first new
    contents are kept in memory; once there are PACK_MIN of them a pack is opened and they, and every
    later one, are written into it at once, so the disk writes overlap the rest of the scan (a warm
    snapshot's few new contents end up loose, as `ObjectStore.add` decides). Bytes are used only if
    the file's stat is the same after the read as before it and not racily recent (git's rule), so
    they are one instant's content; any other new file is read again by `store_rest`, and refused
    (`content_changed`) if it no longer hashes as the scan recorded.
    """

    def __init__(self, store: ObjectStore, racy_after_ns: int, budget: int = KEEP_BYTES) -> None:
        self.store = store
        self.racy_after_ns = racy_after_ns
        self.budget = budget
        self.kept: Dict[str, bytes] = {}
        self.pack: Optional[PackWriter] = None

    def hash(self, path: str, st: os.stat_result) -> str:
        if st.st_size > self.budget:
            return hash_file(path)
        fd = os.open(path, os.O_RDONLY)  # not open(): this runs per file, and a buffered reader adds nothing
        try:
            data = read_to_end(fd, st.st_size)
            after = os.fstat(fd)
        finally:
            os.close(fd)
        sha = hashlib.sha256(data).hexdigest()
        steady = stat_key(after) == stat_key(st) and st.st_mtime_ns < self.racy_after_ns
        if steady and not self.collected(sha):
            self.collect(sha, data)
        return sha

    def collected(self, sha: str) -> bool:
        return sha in self.kept or (self.pack is not None and sha in self.pack.index) or self.store.has(sha)

    def collect(self, sha: str, data: bytes) -> None:
        """Keep a new content; at the PACK_MIN-th, open a pack and write those kept and every later one to it."""
        self.kept[sha] = data
        if self.pack is None and len(self.kept) < PACK_MIN:
            self.budget -= len(data)
            return
        self.pack = self.pack or PackWriter(self.store)
        for kept_sha, kept_data in self.kept.items():
            self.pack.add(ObjectStore.from_bytes(kept_sha, kept_data))
        self.kept.clear()

    def store_rest(self, sources: List[Tuple[str, str]]) -> Added:
        """Store the new contents not stored yet (`sources`: (path, sha256) of every file) and finish the pack."""
        rest = self.store.from_files(sources, self.kept)  # the pack skips what it holds already, unread
        self.kept.clear()
        if self.pack is None:
            return self.store.add(rest)
        for item in rest:
            self.pack.add(item)
        return self.pack.finish()

    def abort(self) -> None:
        """Remove the pack being written, if any: the store is then as it was."""
        if self.pack is not None:
            self.pack.abort()


class PackWriter:
    """One pack being written: items appended as they come, then `finish` (a complete pack) or `abort`.

    Its temp file is its own (not `staged_file`): it grows over a whole scan. Every WRITEBACK_BYTES it
    asks the kernel to start writing what it has (posix_fadvise DONTNEED starts writeback of dirty
    pages), so the disk works while the scan reads and hashes, and the fsync in `finish` waits less.
    """

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.made_dir = not os.path.isdir(store.pack_dir)
        os.makedirs(store.pack_dir, mode=0o700, exist_ok=True)
        try:
            fd, self.tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=store.pack_dir)
        except BaseException:
            if self.made_dir:
                rmdir_quietly(store.pack_dir)  # a full disk leaves no empty pack folder either
            raise
        self.out = os.fdopen(fd, "wb")
        self.index: Dict[str, List[int]] = {}
        self.size = 0
        self.written_back = 0

    def add(self, item: Incoming) -> None:
        if item.sha in self.index:
            return  # identical files share one object
        try:
            size = item.pour(self.out)
        except OSError as exc:
            name_the_folder(exc, self.store.pack_dir)
            raise
        self.index[item.sha] = [self.size, size]
        self.size += size
        if self.size - self.written_back >= WRITEBACK_BYTES and hasattr(os, "posix_fadvise"):
            self.out.flush()
            os.posix_fadvise(self.out.fileno(), self.written_back, self.size - self.written_back,
                             os.POSIX_FADV_DONTNEED)
            self.written_back = self.size

    def finish(self) -> Added:
        """Pack fsynced, index (atomic), pack renamed into place, folder fsynced; removed again if that fails."""
        name = "pack-" + hashlib.sha256("".join(sorted(self.index)).encode()).hexdigest()
        pack = os.path.join(self.store.pack_dir, name + ".pack")
        index_path = other_half(pack)
        if os.path.exists(pack) and os.path.exists(index_path):
            self.abort()
            return Added()  # these very objects are packed already (a prune killed after its rewrite)
        placed: List[str] = []
        try:
            self.out.flush()
            os.fchmod(self.out.fileno(), 0o400)
            os.fsync(self.out.fileno())
            self.out.close()
            self.store.pause("pack_written")
            placed.append(index_path)  # atomic_write leaves nothing behind when it fails
            atomic_write(index_path, json.dumps({"version": 1, "objects": self.index}, separators=(",", ":")).encode(),
                         0o400)
            self.store.pause("pack_indexed")
            os.replace(self.tmp, pack)
            placed.append(pack)
            fsync_dir(self.store.pack_dir)
        except BaseException as exc:
            Added(paths=placed).undo()
            self.abort()
            name_the_folder(exc, self.store.pack_dir)
            raise
        self.store.forget_packs()
        return Added(len(self.index), self.size, [index_path, pack])

    def abort(self) -> None:
        self.out.close()
        remove_quietly(self.tmp)
        if self.made_dir:
            rmdir_quietly(self.store.pack_dir)


# ---------------------------------------------------------------- the store


class ObjectStore:
    """The objects of one state folder, loose and packed: look-up, checked reads, batched writes, prune.

    The pack indexes are read once, on first use; create one ObjectStore per op.
    """

    def __init__(self, ctx: Context, pause: Pause = no_pause) -> None:
        self.root = ctx.path("objects")
        self.pack_dir = ctx.path("objects", "pack")
        self.pause = pause
        self._packed: Optional[Dict[str, Tuple[str, int, int]]] = None
        self._loose: Optional[Set[str]] = None

    def loose_path(self, sha: str) -> str:
        return "%s/%s/%s" % (self.root, sha[:2], sha[2:])  # hot: called per file per snapshot

    @property
    def packed(self) -> Dict[str, Tuple[str, int, int]]:
        """sha256 -> (pack path, offset, size) of every object in a complete pack."""
        if self._packed is None:
            self._packed = {
                sha: (pack, place[0], place[1]) for pack, index in self.packs() for sha, place in index.items()
            }
        return self._packed

    def packs(self) -> List[Tuple[str, Dict[str, List[int]]]]:
        """(pack path, its index) of every pack that has both files."""
        names = set(os.listdir(self.pack_dir)) if os.path.isdir(self.pack_dir) else set()
        found = []
        for name in sorted(n for n in names if PACK_NAME.match(n) and n.endswith(".idx")):
            if name[:-4] + ".pack" not in names:
                continue  # killed between writing the index and renaming the pack: not a pack
            path = os.path.join(self.pack_dir, name)
            try:
                with open(path, "rb") as f:
                    index = json.loads(f.read())["objects"]
            except (ValueError, KeyError, TypeError):
                raise corrupt_object("(index)", path) from None
            found.append((other_half(path), index))
        return found

    @property
    def loose(self) -> Set[str]:
        """The names of the loose objects, listed once (a snapshot asks for every file of the package)."""
        if self._loose is None:
            self._loose = {sha for sha, _ in self.loose_objects()}
        return self._loose

    def has(self, sha: str) -> bool:
        return sha in self.packed or sha in self.loose

    def chunks(self, sha: str) -> Iterator[bytes]:
        """The stored bytes of `sha`, unchecked (FileNotFoundError if the store lacks it)."""
        where = self.packed.get(sha)
        if where is None:
            yield from file_chunks(self.loose_path(sha))
            return
        pack, offset, left = where
        with open(pack, "rb") as f:
            f.seek(offset)
            while left > 0:
                block = f.read(min(CHUNK, left))
                if not block:
                    return  # a truncated pack: the caller's hash check refuses it
                left -= len(block)
                yield block

    def stored(self, sha: str) -> Incoming:
        """`sha` as it sits in this store, to be copied somewhere; refused as object_corrupt if damaged."""
        where = self.packed.get(sha)
        place = where[0] if where else self.loose_path(sha)
        return Incoming(sha, lambda: self.chunks(sha), lambda: corrupt_object(sha, place))

    def read(self, sha: str) -> bytes:
        """The checked content of `sha`."""
        data = b"".join(self.chunks(sha))
        if hashlib.sha256(data).hexdigest() != sha:
            raise self.stored(sha).refusal()
        return data

    def staged_copy(self, sha: str, folder: str, mode: int) -> str:
        """A fsynced temp file in `folder` with the checked content of `sha` and `mode` (a restore's staging)."""
        return staged(self.stored(sha), folder, mode)[0]

    # ------------------------------------------------------------ writing

    def from_files(self, sources: List[Tuple[str, str]], kept: Dict[str, bytes]) -> List[Incoming]:
        """The contents of (path, sha256) files the store lacks, once each: from `kept` bytes, else read again."""
        unique = {sha: path for path, sha in sources}  # identical files share one object
        return [self.from_file(path, sha, kept.get(sha)) for sha, path in unique.items() if not self.has(sha)]

    @staticmethod
    def from_file(path: str, sha: str, data: Optional[bytes] = None) -> Incoming:
        """`data`, if given, are the bytes of `path` that this process hashed to `sha`; else the file is read again."""
        if data is not None:
            return ObjectStore.from_bytes(sha, data)
        return Incoming(sha, lambda: file_chunks(path), lambda: changed_file(path))

    @staticmethod
    def from_bytes(sha: str, data: bytes) -> Incoming:
        """Bytes this process hashed to `sha` (immutable, in memory): stored without a second hash, never refused."""
        return Incoming(sha, lambda: (data,), lambda: corrupt_object(sha, "memory"), hashed=True)

    def add(self, items: List[Incoming]) -> Added:
        """Store `items` durably: one pack if there are at least PACK_MIN, else loose; nothing is left if it fails."""
        if len(items) >= PACK_MIN:
            return self.write_pack(items)
        return self.write_loose(items)

    def write_loose(self, items: List[Incoming]) -> Added:
        """Loose objects with one sync instead of one fsync each: temps, syncfs, renames, syncfs."""
        items = [i for i in items if not os.path.exists(self.loose_path(i.sha))]
        self._loose = None  # listed again when next asked: these are added, or undone if this fails
        staged_files: List[Tuple[str, str]] = []
        done: List[str] = []
        size = 0
        if not items:
            return Added()
        try:
            for item in items:
                dest = self.loose_path(item.sha)
                os.makedirs(os.path.dirname(dest), mode=0o700, exist_ok=True)
                tmp, n = staged(item, os.path.dirname(dest), 0o400, durable=False)
                staged_files.append((tmp, dest))
                size += n
            sync_filesystem(self.root)
            for tmp, dest in staged_files:
                os.replace(tmp, dest)
                done.append(dest)
            sync_filesystem(self.root)
        except BaseException:
            for tmp, _ in staged_files:
                remove_quietly(tmp)
            Added(paths=done).undo()
            for item in items:  # a folder made for a temp that failed half-way (a non-empty one stays)
                rmdir_quietly(os.path.dirname(self.loose_path(item.sha)))
            raise
        return Added(len(done), size, done)

    def write_pack(self, items: List[Incoming]) -> Added:
        """One pack with every item (see PackWriter.finish for the order that keeps it crash-safe)."""
        writer = PackWriter(self)
        try:
            for item in items:
                writer.add(item)
        except BaseException:
            writer.abort()
            raise
        return writer.finish()

    def forget_packs(self) -> None:
        """Read the pack indexes again when next asked (a pack was added or removed)."""
        self._packed = None

    # ------------------------------------------------------------ prune

    def prune(self, used: Set[str], dry_run: bool) -> Tuple[int, int]:
        """Free every object not in `used`, loose or packed, and what killed runs left; (objects, bytes).

        A pack whose objects are all unused is deleted (index first); a pack with some used ones is
        rewritten: they go to a new pack (or loose, if few) made durable before the old one goes, so a
        kill at any instant leaves every used object stored at least once.
        """
        loose = self.unused_loose(used)
        shrink = [(pack, index, [s for s in index if s not in used]) for pack, index in self.packs()]
        shrink = [(pack, index, unused) for pack, index, unused in shrink if unused]
        leftovers = self.leftovers()
        objects = len(loose) + sum(len(unused) for _, _, unused in shrink)
        freed = sum(size for _, size in loose + leftovers) + sum(
            index[s][1] for _, index, unused in shrink for s in unused
        )
        if not dry_run:
            for pack, index, _ in shrink:
                self.drop_from_pack(pack, [s for s in index if s in used])
            Added(paths=[path for path, _ in loose + leftovers]).undo()
            self._loose = None  # listed again when next asked
        return objects, freed

    def drop_from_pack(self, pack: str, keep: List[str]) -> None:
        """Rewrite `pack` with only `keep` (none: just delete it); the new copies are durable first."""
        if keep:
            self.add([self.stored(sha) for sha in keep])
            self.pause("pack_rewritten")
        Added(paths=[other_half(pack), pack]).undo()
        self.forget_packs()

    def unused_loose(self, used: Set[str]) -> List[Tuple[str, int]]:
        """(path, size) of every loose object whose sha256 is not in `used`."""
        return [(path, os.path.getsize(path)) for sha, path in self.loose_objects() if sha not in used]

    def loose_objects(self) -> Iterator[Tuple[str, str]]:
        """(sha256, path) of every loose object, in name order."""
        for prefix in sorted(os.listdir(self.root)) if os.path.isdir(self.root) else []:
            folder = os.path.join(self.root, prefix)
            if not PREFIX.match(prefix) or not os.path.isdir(folder):
                continue
            for name in sorted(os.listdir(folder)):
                if SHA.match(prefix + name):
                    yield prefix + name, os.path.join(folder, name)

    def leftovers(self) -> List[Tuple[str, int]]:
        """(path, size) of temp files, and of a pack's index or pack whose other half is missing."""
        found: List[Tuple[str, int]] = []
        for folder, _, names in os.walk(self.root):
            for name in sorted(names):
                path = os.path.join(folder, name)
                if name.startswith(TEMP_PREFIX) or (
                    folder == self.pack_dir and PACK_NAME.match(name) and not os.path.exists(other_half(path))
                ):
                    found.append((path, os.path.getsize(path)))
        return found
