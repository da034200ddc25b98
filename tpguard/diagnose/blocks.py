"""Clean blocks: stretches where every rank recorded the same values, compared as raw bytes.

A block is the next n lines of every file still being read. It is clean when each line of the
first file is a step record of the run in tpguard's own layout (compact, or the spacing of a
standard `json.dumps`), and the files' blocks are byte-identical once each file's `ranks` field
is removed: every rank then holds the same value of every quantity at every step, and nothing
needs parsing. The first file's lines are checked as templates: hex digits masked, each
distinct template (a handful per block: step-number widths, sites) matched once by a regex that
only accepts a step record of this run with 16-hex-digit or null values.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import orjson

COMPACT_STEP = b'{"type":"step",'
SPACED_STEP = b'{"type": "step", '
_MASK = bytes.maketrans(b"0123456789abcdef", b"\0" * 16)
_CAPTURED = b'"' + b"\0" * 16 + b'"'  # a masked fingerprint: the template holds a compared value
RANKS_FIELD = re.compile(rb',"ranks":(\[[0-9, ]*\])')
STEP_NUMBER = re.compile(rb',"step":([0-9]+),"site":"')
STEP_SITE = re.compile(rb',"step":([0-9]+),"site":"([^"\\]*)"')
MAX_TEMPLATES = 32


def looks_like_step(line: bytes) -> bool:
    """Cheap test before a block is tried: a step record in a layout the block check reads."""
    return line.startswith(COMPACT_STEP) or line.startswith(SPACED_STEP)


@dataclass
class CleanBlock:
    steps: list[int]  # step of each line, in order
    covered: frozenset[int]  # ranks that recorded every line of the block
    first_site: str
    last_sites: set[str]  # sites recorded at the block's last step


def _compact(block: bytes) -> bytes:
    """json.dumps's default spacing made compact. Only for blocks without a backslash: a string
    there holds no quote, so `": ` and `, "` can only be separators."""
    return block.replace(b'": ', b'":').replace(b', "', b',"')


class BlockChecker:
    def __init__(self, run_id: str):
        def lit(b: bytes) -> bytes:
            return re.escape(b.translate(_MASK))

        string = rb'"[^"\\\n]*"'  # masked: hex digits read as NUL (raw NUL bytes are refused before)
        value = rb'(?:"\x00{16}"|null)'
        pair = string + b":" + value
        self.template = re.compile(
            lit(b'{"type":"step","run_id":' + orjson.dumps(run_id) + b',"step":') + rb"\x00+"
            + lit(b',"site":') + string + lit(b',"ranks":') + rb"\[[\x00, ]*\]"
            + lit(b',"fp":{') + rb"(?:" + pair + rb",)*" + pair + lit(b"}}"))

    def check(self, cursors: list, n: int) -> CleanBlock | None:
        """The block of the next n lines of every cursor if it is clean, else None."""
        blocks = [c.block(n) for c in cursors]
        first = blocks[0]
        if not first.endswith(b"\n") or b"\0" in first:
            return None  # a torn last line (only a file's last line lacks its newline), or bytes no JSON line holds
        if not first.startswith(COMPACT_STEP):
            if not first.startswith(SPACED_STEP) or any(b"\\" in b for b in blocks):
                return None
            blocks = [_compact(b) for b in blocks]
            first = blocks[0]
        covered: set[int] = set()
        reference = None
        for c, b in zip(cursors, blocks):
            m = RANKS_FIELD.search(b, 0, b.index(b"\n"))
            if m is None:
                return None
            field = m.group(0)
            rest = b.replace(field, b"")
            if len(b) - len(rest) != n * len(field):  # one ranks value per file throughout the block
                return None
            ranks = orjson.loads(m.group(1))
            if not ranks or len(set(ranks)) != len(ranks) or not c.header_ranks.issuperset(ranks):
                return None
            covered.update(ranks)
            if reference is None:
                reference = rest
            elif rest != reference:
                return None
        if len(covered) < 2:
            return None
        templates = set(first.translate(_MASK).split(b"\n"))
        templates.discard(b"")
        if len(templates) > MAX_TEMPLATES:
            return None
        for t in templates:
            if _CAPTURED not in t or self.template.fullmatch(t) is None:
                return None
        numbers = STEP_NUMBER.findall(first)
        if len(numbers) != n:
            return None
        steps = list(map(int, numbers))
        if not all(map(operator.lt, steps, steps[1:])) and not _in_order(first, steps):
            return None
        if any(steps[0] <= c.last_step for c in cursors):
            return None  # the slow path checks the order across the boundary
        raw = cursors[0].buf
        pos = cursors[0].pos
        last_sites = set()
        i = n - 1
        while i >= 0 and steps[i] == steps[-1]:
            last_sites.add(orjson.loads(raw[pos + i])["site"])
            i -= 1
        first_site = orjson.loads(raw[pos])["site"]
        return CleanBlock(steps, frozenset(covered), first_site, last_sites)


def _in_order(block: bytes, steps: list[int]) -> bool:
    """Steps never decrease and no (step, site) repeats (several sites per step)."""
    pairs = STEP_SITE.findall(block)
    if len(pairs) != len(steps):
        return False
    prev, seen = -1, set()
    for step, (_, site) in zip(steps, pairs):
        if step != prev:
            if step < prev:
                return False
            prev, seen = step, set()
        elif site in seen:
            return False
        seen.add(site)
    return True
