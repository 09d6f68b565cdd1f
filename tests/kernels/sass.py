"""What a compiled kernel costs per element, read from its SASS (``cuobjdump -sass``): no GPU needed.

A Triton program runs its code once per thread (``32 * num_warps`` threads) on a tile of
``elements``; a loop-free kernel therefore issues ``instructions * threads / elements`` thread
instructions per element. Three parts of a listing are not the straight line every thread runs:

- subroutines (``CALL`` targets up to their ``RET``): IEEE division's slow path, taken only for
  denormal or extreme operands; left out;
- loops (a backward ``BRA``): the body is reported apart, so a caller multiplies it by the trip
  count it knows (the reduce kernel's row loop);
- ``NOP`` padding and the closing ``BRA`` to itself.

Everything else counts once, branches taken or not (an upper bound for code behind a forward
branch, e.g. the own-row store of one row in P).

The budget: an H100 SXM (132 SMs, 4 warp schedulers each, 1.98 GHz boost, 3.35 TB/s HBM3) issues
at most 132 * 4 * 32 * 1.98e9 thread instructions per second. A kernel that moves B bytes per
element at 0.8 of the bandwidth handles 0.8 * 3.35e12 / B elements per second, so it may issue at
most ``ISSUE_PER_BYTE * B`` instructions per element (about 12.5 B), and that at a perfect issue
rate: the budget is a ceiling that a kernel must be under, not a promise that being under it
reaches 0.8.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

H100_SMS, SCHEDULERS, LANES, BOOST_HZ, HBM_BYTES_S = 132, 4, 32, 1.98e9, 3.35e12
ISSUE_PER_BYTE = H100_SMS * SCHEDULERS * LANES * BOOST_HZ / (0.8 * HBM_BYTES_S)

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_TARGET = re.compile(r"0x([0-9a-f]+)")
# Opcode families reported apart: what moves data outside registers, or waits for it.
FAMILIES = {
    "SHFL": ("SHFL",),
    "LDS": ("LDS", "LDSM"),
    "STS": ("STS", "STSM"),
    "BAR": ("BAR",),
    "ATOM": ("ATOM", "ATOMG", "RED", "REDG", "ATOMS"),
    "MEMBAR": ("MEMBAR",),
    "MUFU": ("MUFU",),
    "I2F/F2I": ("I2F", "F2I", "I2FP", "F2IP", "FRND", "F2F"),
}


@dataclass(frozen=True)
class Instr:
    addr: int
    opcode: str  # with modifiers, e.g. "LDG.E.128"
    operands: str

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]


def parse(listing: str) -> list[Instr]:
    """The instructions of a single-kernel ``cuobjdump -sass`` listing, in address order."""
    out = []
    for line in listing.splitlines():
        m = _LINE.match(line)
        if m:
            out.append(Instr(int(m.group(1), 16), m.group(3), m.group(4).strip()))
    return out


def _target(ins: Instr) -> int | None:
    m = _TARGET.search(ins.operands)
    return int(m.group(1), 16) if m else None


def _subroutines(code: list[Instr]) -> set[int]:
    """Addresses inside CALL targets (from the target to the first RET after it)."""
    starts = {t for ins in code if ins.base == "CALL" and (t := _target(ins)) is not None}
    inside: set[int] = set()
    for start in starts:
        for ins in code:
            if ins.addr >= start:
                inside.add(ins.addr)
                if ins.base == "RET":
                    break
    return inside


@dataclass
class KernelCost:
    """Instruction counts of one kernel (straight line; loop bodies apart) and its memory ops."""

    straight: int = 0
    loop_body: int = 0
    families: Counter = field(default_factory=Counter)
    global_loads: Counter = field(default_factory=Counter)  # access width in bits -> count
    global_stores: Counter = field(default_factory=Counter)

    def per_element(self, threads: int, elements: int, trips: int = 0) -> float:
        return (self.straight + trips * self.loop_body) * threads / elements


def _width(opcode: str) -> int:
    """Bits per thread of a global access: LDG.E.128 -> 128, LDG.E.U8 -> 8, LDG.E -> 32."""
    mods = opcode.split(".")[1:]
    for m in mods:
        if m.isdigit():
            return int(m)
        if m in ("U8", "S8"):
            return 8
        if m in ("U16", "S16"):
            return 16
    return 32


def cost(listing: str) -> KernelCost:
    code = parse(listing)
    skip = _subroutines(code)
    loops = [
        (t, ins.addr)
        for ins in code
        if ins.base == "BRA" and ins.addr not in skip and (t := _target(ins)) is not None and t < ins.addr
    ]
    res = KernelCost()
    for ins in code:
        if ins.addr in skip or ins.base == "NOP" or (ins.base == "BRA" and _target(ins) == ins.addr):
            continue
        if any(lo <= ins.addr <= hi for lo, hi in loops):
            res.loop_body += 1
        else:
            res.straight += 1
        for fam, bases in FAMILIES.items():
            if ins.base in bases:
                res.families[fam] += 1
        if ins.base == "LDG":
            res.global_loads[_width(ins.opcode)] += 1
        elif ins.base == "STG":
            res.global_stores[_width(ins.opcode)] += 1
    return res
