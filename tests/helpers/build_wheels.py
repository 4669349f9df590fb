"""Author-time tool: build the tiny pure-Python wheels that the dependency-repair tasks
ship in their wheelhouse, byte for byte reproducibly (fixed timestamps and order).

    .venv/bin/python tests/tasks/build_wheels.py      # rewrites every wheelhouse

`tests/tasks/test_builtin_suite.py` rebuilds them in memory and compares with the
committed files, so a wheel can never drift from its source below.
"""

from __future__ import annotations

import base64
import hashlib
import io
import sys
import zipfile
from pathlib import Path

BUILTIN = Path(__file__).resolve().parents[2] / "src" / "ridgeline" / "tasks" / "builtin"

TINYFMT_1 = '''"""tinyfmt 1.x: plain-text tables."""

__version__ = "1.0.0"


def format_table(rows):
    """Rows (lists of values) as text: columns padded to the widest cell, joined by ' | '."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))] if cells else []
    return "\\n".join(" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in cells)
'''

TINYFMT_2 = '''"""tinyfmt 2.x: plain-text tables and money. `format_table` was removed in 2.0."""

__version__ = "2.0.0"


def table(rows, header=None, sep=" | "):
    """Rows as text; with `header`, a header line and a rule of dashes come first."""
    cells = [[str(c) for c in row] for row in rows]
    if header is not None:
        cells.insert(0, [str(h) for h in header])
    if not cells:
        return ""
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = [sep.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    if header is not None:
        lines.insert(1, "-" * len(sep.join("-" * w for w in widths)))
    return "\\n".join(lines)


def money(value):
    """1234.5 -> '1,234.50'."""
    return f"{value:,.2f}"
'''

REPORTKIT = '''"""reportkit: titled text reports on top of tinyfmt 2."""

import tinyfmt

__version__ = "1.0.0"


def render(title, rows, header=None):
    body = tinyfmt.table(rows, header=header)
    return f"{title}\\n{'=' * len(title)}\\n{body}\\n"
'''

UNITCONV = '''"""unitconv: a few unit conversions."""

__version__ = "0.3.0"


def km_to_miles(km):
    return km * 0.621371


def c_to_f(celsius):
    return celsius * 9 / 5 + 32
'''

# name, version, module source, requirements
PACKAGES = {
    "tinyfmt-1.0.0": ("tinyfmt", "1.0.0", TINYFMT_1, []),
    "tinyfmt-2.0.0": ("tinyfmt", "2.0.0", TINYFMT_2, []),
    "reportkit-1.0.0": ("reportkit", "1.0.0", REPORTKIT, ["tinyfmt>=2.0"]),
    "unitconv-0.3.0": ("unitconv", "0.3.0", UNITCONV, []),
}

# task directory -> wheels in its files/wheelhouse
WHEELHOUSES = {
    "dep-install-from-wheelhouse": ["tinyfmt-2.0.0"],
    "dep-fix-version-pin": ["tinyfmt-1.0.0", "tinyfmt-2.0.0"],
    "dep-transitive-requirement": ["reportkit-1.0.0", "tinyfmt-1.0.0", "tinyfmt-2.0.0"],
    "dep-downgrade-breaking-release": ["tinyfmt-1.0.0", "tinyfmt-2.0.0"],
    "dep-fix-requirements-typo": ["tinyfmt-2.0.0", "unitconv-0.3.0"],
}

# task directory -> wheels already unpacked into its files/vendor (an installed state)
PREINSTALLED = {
    "dep-downgrade-breaking-release": ["tinyfmt-2.0.0"],
}

_DATE = (2024, 1, 1, 0, 0, 0)


def _record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def build_wheel(key: str) -> tuple[str, bytes]:
    """(file name, bytes) of one wheel."""
    name, version, source, requires = PACKAGES[key]
    dist = f"{name}-{version}.dist-info"
    metadata = "Metadata-Version: 2.1\n" f"Name: {name}\n" f"Version: {version}\n" \
        f"Summary: {source.splitlines()[0].strip(chr(34))}\n" + \
        "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {
        f"{name}/__init__.py": source.encode(),
        f"{dist}/METADATA": metadata.encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: ridgeline-build-wheels\n"
                         b"Root-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist}/top_level.txt": f"{name}\n".encode(),
    }
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n"
                     for path, data in files.items()) + f"{dist}/RECORD,,\n"
    files[f"{dist}/RECORD"] = record.encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            info = zipfile.ZipInfo(path, date_time=_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, data)
    return f"{name}-{version}-py3-none-any.whl", buf.getvalue()


def expected_wheelhouses() -> dict[Path, dict[str, bytes]]:
    out: dict[Path, dict[str, bytes]] = {}
    for task, keys in WHEELHOUSES.items():
        out[BUILTIN / task / "files" / "wheelhouse"] = dict(build_wheel(k) for k in keys)
    return out


def expected_vendor_files() -> dict[Path, bytes]:
    """Files of the pre-installed packages, as `pip install --target` leaves them."""
    out: dict[Path, bytes] = {}
    for task, keys in PREINSTALLED.items():
        vendor = BUILTIN / task / "files" / "vendor"
        for key in keys:
            _, wheel = build_wheel(key)
            with zipfile.ZipFile(io.BytesIO(wheel)) as zf:
                for name in zf.namelist():
                    out[vendor / name] = zf.read(name)
    return out


def main() -> int:
    for house, wheels in expected_wheelhouses().items():
        house.mkdir(parents=True, exist_ok=True)
        for old in house.glob("*.whl"):
            if old.name not in wheels:
                old.unlink()
        for fname, data in wheels.items():
            (house / fname).write_bytes(data)
            print(f"wrote {house / fname} ({len(data)} bytes)")
    for path, data in expected_vendor_files().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
