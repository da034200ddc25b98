"""Clean blocks: stretches where every rank recorded the same values, compared as raw bytes.

A block is the next n lines of the files whose next record is at the smallest step. It is clean
when each line of the first file is a step record of the run in tpguard's key order, spaced as
tpguard writes it (compact) or as a standard `json.dumps` does (", " and ": "), and the files'
blocks are byte-identical once each file's `ranks` field is removed: every rank then holds the
same value of every quantity at every step, and nothing needs parsing. The first file's lines are checked as templates: hex digits masked, each
distinct template (a handful per block: step-number widths, sites) matched once by a regex that
only accepts a step record of this run with 16-hex-digit or null values.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import orjson

from tpguard.records import MAX_STEP

_MASK = bytes.maketrans(b"0123456789abcdef", b"\0" * 16)
_CAPTURED = b'"' + b"\0" * 16 + b'"'  # a masked fingerprint: the template holds a compared value
MAX_TEMPLATES = 32


@dataclass(frozen=True)
class Layout:
    """The patterns of one spacing of tpguard's step records (key order: type, run_id, step,
    site, ranks, fp)."""

    start: bytes
    ranks_field: re.Pattern  # the field removed before files are compared; group 1 the list
    step_number: re.Pattern
    step_site: re.Pattern
    template: re.Pattern  # a whole line, hex digits masked


def _layout(run_id: str, colon: bytes, comma: bytes) -> Layout:
    def lit(b: bytes) -> bytes:
        return re.escape(b.translate(_MASK))

    string = rb'"[^"\\\n]*"'  # masked: hex digits read as NUL (raw NUL bytes are refused before)
    pair = string + lit(colon) + rb'(?:"\x00{16}"|null)'
    key = lambda name: comma + b'"' + name + b'"' + colon  # noqa: E731
    template = (lit(b'{"type"' + colon + b'"step"' + key(b"run_id") + orjson.dumps(run_id) + key(b"step"))
                + rb"\x00+" + lit(key(b"site")) + string + lit(key(b"ranks")) + rb"\[[\x00, ]*\]"
                + lit(key(b"fp") + b"{") + rb"(?:" + pair + lit(comma) + rb")*" + pair + lit(b"}}"))
    return Layout(
        start=b'{"type"' + colon + b'"step"' + comma,
        ranks_field=re.compile(re.escape(key(b"ranks")) + rb"(\[[0-9, ]*\])"),
        # at most 19 digits: a longer step is out of range (int() of thousands of digits even
        # raises); the block is then not clean and the parsed path names the line
        step_number=re.compile(re.escape(key(b"step")) + rb"([0-9]{1,19})" + re.escape(key(b"site") + b'"')),
        step_site=re.compile(re.escape(key(b"step")) + rb"([0-9]{1,19})" + re.escape(key(b"site")) + rb'"([^"\\]*)"'),
        template=re.compile(template))


STARTS = (b'{"type":"step",', b'{"type": "step", ')


def looks_like_step(line: bytes) -> bool:
    """Cheap test before a block is tried: a step record in a layout the block check reads."""
    return line.startswith(STARTS)


@dataclass
class CleanBlock:
    steps: list[int]  # step of each line, in order
    covered: frozenset[int]  # ranks that recorded every line of the block (compared when two or more)
    first_site: str
    last_sites: set[str]  # sites recorded at the block's last step


class BlockChecker:
    def __init__(self, run_id: str):
        # tpguard's writer (orjson), and a standard json.dumps (", " and ": ")
        self.layouts = (_layout(run_id, b":", b","), _layout(run_id, b": ", b", "))

    def check(self, cursors: list, n: int) -> CleanBlock | None:
        """The block of the next n lines of every cursor if it is clean, else None."""
        blocks = [c.block(n) for c in cursors]
        first = blocks[0]
        if not first.endswith(b"\n") or b"\0" in first:
            return None  # a torn last line (only a file's last line lacks its newline), or bytes no JSON line holds
        layout = next((x for x in self.layouts if first.startswith(x.start)), None)
        if layout is None:
            return None
        covered: set[int] = set()
        reference = None
        for c, b in zip(cursors, blocks):
            m = layout.ranks_field.search(b, 0, b.index(b"\n"))
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
        templates = set(first.translate(_MASK).split(b"\n"))
        templates.discard(b"")
        if len(templates) > MAX_TEMPLATES:
            return None
        for t in templates:
            if _CAPTURED not in t or layout.template.fullmatch(t) is None:
                return None
        numbers = layout.step_number.findall(first)
        if len(numbers) != n:
            return None
        steps = list(map(int, numbers))
        if max(steps) > MAX_STEP:
            return None
        if not all(map(operator.lt, steps, steps[1:])) and not _in_order(layout, first, steps):
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


def _in_order(layout: Layout, block: bytes, steps: list[int]) -> bool:
    """Steps never decrease and no (step, site) repeats (several sites per step)."""
    pairs = layout.step_site.findall(block)
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
