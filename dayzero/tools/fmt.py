"""Plain-text rendering shared by the tools: sizes, counts, layer ranges and aligned tables."""
from __future__ import annotations


def size(n: float) -> str:
    """Bytes in binary units: 1.50 KiB, 2.07 MiB, 5.65 TiB."""
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def count(n: float) -> str:
    """Parameter counts in decimal units, as models are named: 2.83T, 37.0B, 6.8M."""
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.{3 if div == 1e12 else 2}f}{unit}".replace(".000T", "T")
    return f"{n:.0f}"


def tokens(n: int) -> str:
    if n >= 2**20 and n % 2**20 == 0:
        return f"{n // 2**20}M"
    if n >= 2**10 and n % 2**10 == 0:
        return f"{n // 2**10}K"
    return str(n)


def ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out, start, prev = [], None, None
    for i in sorted(indices):
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}-{prev}" if prev > start else str(start))
            start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if prev > start else str(start))
    return ", ".join(out)


def table(rows: list[list], header: list[str], indent: str = "  ") -> str:
    """Columns aligned: text left, numbers (and sizes) right."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[j]) for r in cells) for j in range(len(header))]

    def numeric(j: int) -> bool:
        vals = [r[j] for r in cells[1:] if r[j] not in ("", "-")]
        return bool(vals) and all(v[:1].isdigit() or v[:1] in "-+." for v in vals)

    right = [numeric(j) for j in range(len(header))]
    lines = []
    for k, r in enumerate(cells):
        parts = [c.rjust(w) if right[j] else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))]
        lines.append(indent + "  ".join(parts).rstrip())
        if k == 0:
            lines.append(indent + "  ".join("-" * w for w in widths))
    return "\n".join(lines)
