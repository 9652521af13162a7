"""The wheels the device check needs beyond the bare CUDA machine, and whether they travel: a device call carries the
tree and at most 8 ignored paths, 64 MiB in all.

    python bench/wheel_set.py download wheels                       # bench/device_wheels.txt, for this Python
    python bench/wheel_set.py download wheels --python-version 3.12 # for the machine's Python
    python bench/wheel_set.py check wheels                          # the wheels plus the tree, against 64 MiB

`download` needs a package index (the GPU machine has none); `check` prints one line and exits 1 when the total is
over. Stdlib only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import zipfile
from pathlib import Path

LIMIT_BYTES = 64 * 1024 * 1024
REQUIREMENTS = Path(__file__).with_name("device_wheels.txt")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64")
# what of pyarrow nothing loads unless asked for: Arrow Flight RPC (a library of its own, which no other one links),
# the C++ headers and sources, the tests: about 10 MB of the wheel's 49, without which the set fits
UNUSED_ARROW = ("pyarrow/libarrow_flight", "pyarrow/_flight", "pyarrow/flight.py", "pyarrow/include/", "pyarrow/src/",
                "pyarrow/tests/")


def requirements(path: Path = REQUIREMENTS) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def download(folder: Path, python_version: str) -> None:
    """Each pinned wheel for that Python on x86_64 Linux; an sdist-only package (DeepSpeed) is built here."""
    folder.mkdir(parents=True, exist_ok=True)
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    for requirement in requirements():
        pip = [sys.executable, "-m", "pip", "--quiet"]
        fetched = subprocess.run([*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version",
                                  python_version, *platforms, "-d", str(folder), requirement],
                                 capture_output=True, text=True)
        if fetched.returncode != 0:
            # no wheel published: build one without compiling any op (DeepSpeed compiles them on first use)
            subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(folder), requirement],
                           check=True, env={**os.environ, "DS_BUILD_OPS": "0"})
    for wheel in folder.glob("pyarrow-*.whl"):
        slim(wheel)


def slim(wheel: Path) -> None:
    """Rewrite the wheel without the parts of UNUSED_ARROW, its RECORD listing only what it keeps."""
    target = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out:
        for item in source.infolist():
            if item.filename.startswith(UNUSED_ARROW):
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if not line.startswith(UNUSED_ARROW)]
                data = ("\n".join(kept) + "\n").encode()
            out.writestr(item, data)
    target.replace(wheel)


def tree_bytes(root: Path) -> int:
    """What of the tree travels: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return sum((root / name).stat().st_size for name in listed if name and (root / name).is_file())


def carried(folder: Path, root: Path) -> tuple[int, int]:
    """(the wheels' bytes, the tree's bytes)."""
    return sum(path.stat().st_size for path in folder.glob("*.whl")), tree_bytes(root)


def verdict(wheels: int, tree: int, count: int, limit: int = LIMIT_BYTES) -> tuple[bool, str]:
    mib = 1024 * 1024
    total = wheels + tree
    line = (f"{count} wheels {wheels / mib:.1f} MiB + tree {tree / mib:.1f} MiB = {total / mib:.1f} MiB "
            f"of {limit / mib:.0f} MiB")
    return total <= limit, line if total <= limit else f"too big to travel: {line}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["download", "check"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    args = parser.parse_args()
    if args.action == "download":
        download(args.folder, args.python_version)
    wheels, tree = carried(args.folder, Path(__file__).resolve().parents[1])
    fits, line = verdict(wheels, tree, len(list(args.folder.glob("*.whl"))))
    print(line)
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
