"""Block identity: what names a full KV block in the prefix cache and the tiers.

A block's hash is keyed BLAKE2b-128 over its parent's hash and its token ids;
the chain starts from a root that hashes the request's cache salt, so blocks of
requests with different salts never share a hash (docs/protocol.md §3.2.2).
Without the key, nobody can aim a prompt at another prompt's hash: Python's
unseeded, invertible tuple hash, used before, let a crafted prompt collide
(vLLM's GHSA-rm76-4mrf-v9r8 is the same class of bug).

The rule of a hit, in every tier: the hash finds a candidate, and the candidate
is used only if its own token ids and its parent's hash equal the request's.
The parent's hash stands for the whole prefix before the block (and the salt);
the tokens are compared so that a block's own content never rests on the hash
alone.

The key is random per process, except when there is a disk tier: its blocks
must be found again after a restart, so it keeps its key in a 0600 file beside
them (disk_tier.py) and the manager hashes with that one (attach_tiers)."""
from __future__ import annotations

import hashlib
import os
from array import array
from dataclasses import dataclass, field
from typing import Callable

DIGEST_BYTES = 16
KEY_BYTES = 32
NONE_HASH = bytes(DIGEST_BYTES)  # "no parent known": never a real chain's hash
_ROOT, _BLOCK = b"\x00", b"\x01"  # a root's input can never read as a block's

HashFn = Callable[[bytes], bytes]  # bytes -> DIGEST_BYTES bytes


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def keyed_blake2b(key: bytes) -> HashFn:
    base = hashlib.blake2b(key=key, digest_size=DIGEST_BYTES)  # the key's block, compressed once

    def digest(data: bytes) -> bytes:
        h = base.copy()
        h.update(data)
        return h.digest()
    return digest


class BlockHasher:
    def __init__(self, hash_fn: HashFn | None = None):
        self.fn = hash_fn or keyed_blake2b(new_key())

    def root(self, salt: str = "") -> bytes:
        """The first block's parent for requests with this cache salt."""
        d = self.fn(_ROOT + salt.encode())
        if len(d) != DIGEST_BYTES:
            raise ValueError(f"a block hash is {DIGEST_BYTES} bytes; the hash function gave {len(d)}")
        return d

    def chain(self, token_ids: list[int], block_size: int, parent: bytes, start: int = 0) -> list[bytes]:
        """Hashes of the full blocks of token_ids[start:], chained from `parent`."""
        n = (len(token_ids) - start) // block_size
        packed = array("q", token_ids[start:start + n * block_size]).tobytes()
        step, fn, out = 8 * block_size, self.fn, []
        for i in range(0, n * step, step):
            parent = fn(_BLOCK + parent + packed[i:i + step])
            out.append(parent)
        return out


@dataclass(slots=True)
class BlockChain:
    """One request's full blocks as the prefix cache names them: hashes[i] names block i,
    whose parent is hashes[i - 1] (the root for block 0) and whose tokens are tokens[i].
    A request keeps its chain for life and extend() hashes only blocks that filled since,
    so a step's lookups and publishing cost O(new tokens), not O(context) (vLLM keeps
    request.block_hashes for the same reason). A request's tokens only ever grow."""
    salt: str = ""
    root: bytes | None = None
    hashes: list[bytes] = field(default_factory=list)
    tokens: list[tuple] = field(default_factory=list)

    def extend(self, hasher: BlockHasher, token_ids: list[int], block_size: int, num_blocks: int) -> None:
        """Hash up to num_blocks full blocks of token_ids (which start with the blocks already hashed)."""
        have = len(self.hashes)
        if num_blocks <= have:
            return
        if self.root is None:
            self.root = hasher.root(self.salt)
        parent = self.hashes[-1] if have else self.root
        end = num_blocks * block_size
        self.hashes += hasher.chain(token_ids[:end], block_size, parent, have * block_size)
        self.tokens += [tuple(token_ids[i:i + block_size]) for i in range(have * block_size, end, block_size)]

    def parent(self, i: int) -> bytes:
        return self.hashes[i - 1] if i else self.root
